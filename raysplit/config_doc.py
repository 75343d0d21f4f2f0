"""The configuration reference, generated from the pydantic models (docs/config.md, ``raysplit list config``).

Every key a config file may hold, with its type, default and description, is read from :class:`ExperimentConfig`
and from each algorithm's parameter model, so the reference cannot drift from what validation accepts:
tests/test_config.py fails when docs/config.md is not what :func:`reference` writes today (regenerate it with
``make config-doc``).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

__all__ = ["reference", "rows"]


def _type(ann: Any) -> str:
    """A field's annotation as a reader writes it: ``int``, ``one of sgd, adam``, ``float or null``."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type(a) for a in args)
    if origin in (list, tuple):
        inner = ", ".join(_type(a) for a in args if a is not Ellipsis)
        return f"[{inner}]" if inner else "list"
    if origin is dict:
        return "mapping"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return getattr(ann, "__name__", str(ann))


def _default(field) -> str:
    if field.default is PydanticUndefined:
        if field.default_factory is None:
            return "required"
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return "null" if value is None else repr(value)


def _model_of(ann: Any) -> type[BaseModel] | None:
    """The section model behind ``ann`` (``Model`` or ``Model | None``), if any."""
    for a in (ann, *typing.get_args(ann)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def union_rows(members: dict, key: str, field) -> list[tuple[str, str, str, str]]:
    """The rows of a discriminated union's section ``key``: its tag (name, profile or kind) with every member, the
    keys every member shares once, then each member's own keys marked with its tag."""
    from raysplit.config import tag_key

    tk = tag_key(next(iter(members.values())))
    default = getattr(field.default, tk) if isinstance(field.default, BaseModel) else "required"
    out = [(f"{key}.{tk}", "one of " + ", ".join(members), repr(default),
            "; ".join(sub.model_fields[tk].description or tag for tag, sub in members.items())
            + f" (a key below marked with another {tk} is an error)")]
    every = [rows(sub, key + ".") for sub in members.values()]
    shared = set.intersection(*(set(rs) for rs in every))  # the same row in every member: once
    out += [r for r in every[0] if r in shared and r[0] != f"{key}.{tk}"]
    for tag, rs in zip(members, every):
        out += [(k, t, d, f"({tag}) {desc}") for k, t, d, desc in rs
                if k != f"{key}.{tk}" and (k, t, d, desc) not in shared]
    return out


def rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(dotted key, type, default, description)`` of every field of ``model``, sections expanded in place (the
    section's own row first)."""
    from raysplit.config import tagged_members

    out = []
    for name, field in model.model_fields.items():
        key = prefix + name
        members = tagged_members(field.annotation)
        if members:  # a discriminated union: name (or kind) picks the member, whose own keys follow
            out.append((key, "section", "(section)", field.description or ""))
            out += union_rows(members, key, field)
            continue
        out.append((key, _type(field.annotation), _default(field), field.description or ""))
        sub = _model_of(field.annotation)
        if sub is not None:
            out += rows(sub, key + ".")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _options_tables() -> list[str]:
    """``model.options`` and ``data.options``: each model's and dataset's own keyword arguments (from the builder's
    or loader's signature, as the config checks them)."""
    from raysplit.config import options_model
    from raysplit.data import DATASETS
    from raysplit.models import MODELS

    out: list[str] = []
    for title, key, entries in (("model.options", "model.name", {n: i.builder for n, i in MODELS.items()}),
                                ("data.options", "data.dataset", DATASETS)):
        out += ["", f"## `{title}`: the keyword arguments of each `{key}`", "",
                "Checked against the builder's or loader's signature when the config is read: an unknown key or a "
                "value of the wrong type is an error naming it.", "", f"| `{key}` | option | type | default |",
                "|---|---|---|---|"]
        for name, fn in sorted(entries.items()):
            fields = options_model(fn, name).model_fields
            if not fields:
                out.append(f"| `{name}` | none | | |")
            for opt, field in fields.items():
                out.append(f"| `{name}` | `{opt}` | {_cell(_type(field.annotation))} | `{_cell(_default(field))}` |")
    return out


def reference() -> str:
    """docs/config.md: the generic sections, then every algorithm's parameters (``algorithm.<key>``)."""
    from raysplit.algorithms import ALGORITHMS
    from raysplit.config import MOVED_RUNTIME_KEYS, ExperimentConfig, tagged_members

    lines = ["# Configuration reference", "",
             "<!-- generated by `make config-doc` (raysplit/config_doc.py) from the pydantic models; do not edit: "
             "tests/test_config.py fails when it is out of date -->", "",
             "A config file is YAML with the sections below; every key is optional unless marked *required*, and an "
             "unknown key is an error naming it. Any key can be overridden on the command line as a dotted "
             "`key=value` (`raysplit run configs/quickstart.yaml train.rounds=3`), and swept by Ray Tune "
             "(`raysplit sweep`). `raysplit list config` prints this reference; `raysplit list ALGORITHM` one "
             "algorithm's parameters.", ""]
    top = ExperimentConfig.model_fields
    lines += ["## Top-level keys", "", "| key | type | default | description |", "|---|---|---|---|"]
    for name, field in top.items():
        if name == "algorithm":  # a section whose keys depend on its name: listed per algorithm below
            lines.append(f"| `algorithm` | section (the named algorithm's parameters) | `{{'name': 'sflv2'}}` | "
                         f"{_cell(field.description or '')} |")
        elif _model_of(field.annotation) is None:
            lines.append(f"| `{name}` | {_cell(_type(field.annotation))} | `{_cell(_default(field))}` | "
                         f"{_cell(field.description or '')} |")
    for name, field in top.items():
        sub = _model_of(field.annotation)
        if sub is None or name == "algorithm":
            continue
        lines += ["", f"## `{name}`: {field.description}", "", "| key | type | default | description |",
                  "|---|---|---|---|"]
        members = tagged_members(field.annotation)
        for key, typ, default, desc in (union_rows(members, name, field) if members else rows(sub, name + ".")):
            lines.append(f"| `{key}` | {_cell(typ)} | `{_cell(default)}` | {_cell(desc)} |")
        if name == "runtime":
            moved = ", ".join(f"`{old}` -> `{new}`" for old, new in MOVED_RUNTIME_KEYS.items())
            lines += ["", "Keys the runtime section held directly before it had sections still work, each with a "
                      f"one-line warning naming its new place: {moved}."]
    lines += _options_tables()
    lines += ["", "## `algorithm`: the method and its parameters", "",
              "`algorithm.name` picks the method; the other keys under `algorithm:` are that method's parameters, "
              "validated by its own model (an unknown one is an error naming it).", ""]
    for n, alg in sorted(ALGORITHMS.items()):
        lines += [f"### `{n}`", "", alg.description, ""]
        params = [(k, f) for k, f in alg.Params.model_fields.items() if k != "name"]
        if not params:
            lines += ["No parameters.", ""]
            continue
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for key, field in params:
            lines.append(f"| `algorithm.{key}` | {_cell(_type(field.annotation))} | `{_cell(_default(field))}` | "
                         f"{_cell(field.description or '')} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
