"""How much of the runtime a method needs (issue 69's target): the concepts and the names a method's module uses
from the runtime, counted from its syntax tree.

- **names**: every name imported from the runtime (``raysplit.runtime`` and its modules); every hook a rule class
  overrides (``raysplit.runtime.rules.HOOKS``); every attribute a rule reads from its context (``self.ctx.X``, or a
  local ``ctx = self.ctx``): ``X`` itself for a section, the method's data or a plain value, ``X.Y`` for a method
  or attribute of one of the context's components (``trainer.step``, ``models.main``). What the algorithm class
  does on the driver (``rt.*``, ``setup``) is the algorithms' contract, not the runtime's, and is not counted.
- **concepts**: the kinds of thing the module writes against: a registered algorithm class, its parameters (a
  Params model), a rule (a subclass of one of the runtime's rules, built from a context), a server step over
  typed batches (``batch_step``).

    python scripts/contract_names.py raysplit/algorithms/gas.py raysplit/algorithms/cyclesl.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raysplit.runtime.rules import HOOKS  # noqa: E402

# the context's components: their members count one by one (a section or a value counts once)
COMPONENTS = frozenset({"trainer", "models", "evaluation", "global_model", "data", "meter", "states", "executor",
                        "cut", "events"})
RULE_BASES = frozenset({"ClientRule", "ServerRule", "AsyncRule"})


def _is_rule(base: ast.AST) -> bool:
    """A base class that is a rule: one of the runtime's, or a method's own (the zoo names them ...Rule and
    ...Server: ``CycleServer``, ``AuxRule``)."""
    chain = _attr_chain(base)
    return bool(chain) and (chain[-1] in RULE_BASES or chain[-1].endswith(("Rule", "Server")))


def _attr_chain(node: ast.AST) -> list[str]:
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


def _aliases(cls: ast.ClassDef, bound: set | None = None) -> dict[str, list[str]]:
    """Local names bound to something of the context (``ctx = self.ctx``, ``trainer = ctx.trainer``, also in a
    tuple assignment): name -> its chain from ``ctx``; ``bound`` collects the ids of the nodes bound so."""
    out: dict[str, list[str]] = {"ctx": ["ctx"]}
    for node in ast.walk(cls):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                 else [(target, value)])
        for t, v in pairs:
            chain = _attr_chain(v) if isinstance(v, ast.Attribute) else []
            if chain[:2] == ["self", "ctx"]:
                chain = chain[1:]
            if isinstance(t, ast.Name) and chain[:1] == ["ctx"]:
                out[t.id] = chain
                if bound is not None:
                    bound.add(id(v))
    return out


def count(source: str) -> dict:
    """``{"names": [...], "concepts": [...]}`` of a method's module (or a page's code blocks joined)."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and "runtime" in node.module.split("."):
            names |= {a.asname or a.name for a in node.names}
    rules = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and any(_is_rule(b) for b in c.bases)]
    for cls in rules:
        names |= {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in HOOKS
                  and f.name != "__init__"}
        inner = {id(n.value) for n in ast.walk(cls) if isinstance(n, ast.Attribute)}  # the a.b of a.b.c
        bound: set[int] = set()
        alias = _aliases(cls, bound)
        for node in ast.walk(cls):
            chain = _attr_chain(node) if isinstance(node, ast.Attribute) and id(node) not in inner else []
            if chain and chain[0] in alias:  # trainer = ctx.trainer; trainer.step(...)
                chain = alias[chain[0]] + chain[1:]
            if chain[:2] == ["self", "ctx"]:
                chain = chain[1:]
            if not chain or chain[0] != "ctx" or len(chain) < 2 or (chain[1] in COMPONENTS and len(chain) == 2
                                                                     and id(node) in bound):
                continue  # a component bound to a local name: its uses through the name are counted
            names.add(".".join(chain[1:3]) if chain[1] in COMPONENTS and len(chain) > 2 else chain[1])
    concepts = []
    classes = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
    if any(any(isinstance(d, ast.Name) and d.id == "register" for d in c.decorator_list) for c in classes):
        concepts.append("a registered algorithm")
    if any(any(_attr_chain(b)[-1:] and _attr_chain(b)[-1].endswith("Params") for b in c.bases) for c in classes):
        concepts.append("its parameters")
    if rules:
        concepts.append("a rule over its context")
    if "batch_step" in names:
        concepts.append("a server step over batches")
    return {"names": sorted(names), "concepts": concepts}


def code_blocks(markdown: str) -> str:
    """The ``python`` code blocks of a page, joined (as tests/test_extending.py runs them)."""
    out, inside = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```python" if not inside else False
            continue
        if inside:
            out.append(line)
    return "\n".join(out)


def main(paths: list[str]) -> None:
    for p in paths:
        text = Path(p).read_text()
        got = count(code_blocks(text) if p.endswith(".md") else text)
        print(f"{p}: {len(got['concepts'])} concepts, {len(got['names'])} runtime names")
        print(f"  concepts: {', '.join(got['concepts'])}")
        print(f"  names: {', '.join(got['names'])}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["raysplit/algorithms/gas.py", "raysplit/algorithms/cyclesl.py", "docs/extending.md"])
