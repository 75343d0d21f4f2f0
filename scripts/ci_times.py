"""What CI's time goes to, so that a slow machine is recognisable in CI's own output (docs/testing.md, "CI's time").

    python scripts/ci_times.py speed                   # the machine's speed: ms per cnn_small training step
    python scripts/ci_times.py report TIMES XML...     # the phases' seconds and the 25 slowest tests

``speed`` times a fixed piece of CPU work, the quickstart's model and batch on one torch thread (what one actor does
for each step), so that two machines' CI times can be compared through it. ``report`` reads the phase file that
``.ci/run`` writes (one ``NAME SECONDS`` line per phase, plus ``speed MS`` and ``quickstart S`` lines for the two
speed figures) and pytest's JUnit XML files of the tiers, and prints both as Markdown tables, ready to paste into
docs/testing.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS, WARMUP = 40, 5


def speed() -> float:
    """Median milliseconds of one training step of cnn_small (the quickstart's model) on a batch of 64 Fashion-MNIST
    sized images, forward, backward and SGD, on one torch thread."""
    import statistics

    import torch

    from raysplit.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("cnn_small", 10, (1, 28, 28))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    times = []
    for i in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def slowest(xml_files: list[Path], n: int = 25) -> list[tuple[float, str, str]]:
    """``(seconds, test id, tier file)`` of the ``n`` slowest test cases over the JUnit files (setup and teardown
    included, as pytest's JUnit writer counts them)."""
    cases = []
    for f in xml_files:
        if not f.is_file():
            continue
        for case in ET.parse(f).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            cases.append((float(case.get("time") or 0.0), name, f.stem))
    return sorted(cases, reverse=True)[:n]


def counts(xml_files: list[Path]) -> dict[str, tuple[int, float]]:
    """Per JUnit file: the number of test cases and the seconds pytest reports for them."""
    out = {}
    for f in xml_files:
        if f.is_file():
            suite = ET.parse(f).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            out[f.stem] = (int(suite.get("tests", 0)) - int(suite.get("skipped", 0)), float(suite.get("time", 0.0)))
    return out


def report(times: Path, xml_files: list[Path]) -> str:
    phases, figures = [], {}
    if times.is_file():
        for line in times.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name in ("speed", "quickstart", "cpu"):
                figures[name] = value
            elif value:
                phases.append((name, int(float(value))))
    lines = ["ci: the machine: " + ", ".join(
        f"{what} {figures[key]}" for key, what in (("cpu", "CPU and torch's kernel set:"),
                                                  ("speed", "cnn_small step (ms, 1 thread):"),
                                                  ("quickstart", "quickstart round (s):")) if key in figures)
        if figures else "ci: the machine: no speed figure was measured", "",
        "| phase | seconds | minutes |", "|---|---:|---:|"]
    lines += [f"| {name} | {s} | {s / 60:.1f} |" for name, s in phases]
    total = sum(s for _, s in phases)
    lines += [f"| all | {total} | {total / 60:.1f} |", ""]
    tiers = counts(xml_files)
    if tiers:
        lines += [", ".join(f"{tier}: {n} tests in {s:.0f} s" for tier, (n, s) in tiers.items()), ""]
    top = slowest(xml_files)
    if top:
        lines += [f"the {len(top)} slowest tests:", "", "| seconds | tier | test |", "|---:|---|---|"]
        lines += [f"| {s:.1f} | {tier} | `{name}` |" for s, name, tier in top]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("speed", help="print the machine's speed figure (ms per cnn_small step)")
    sub.add_parser("cpu", help="print the CPU model and torch's CPU kernel set (what float results depend on)")
    rep = sub.add_parser("report", help="print the phases' times and the slowest tests")
    rep.add_argument("times", type=Path)
    rep.add_argument("xml", type=Path, nargs="*")
    args = ap.parse_args(argv)
    if args.command == "speed":
        print(f"{speed():.2f}")
        return 0
    if args.command == "cpu":
        from raysplit.runtime.devices import cpu_kind

        print(cpu_kind())
        return 0
    print(report(args.times, args.xml))
    return 0


if __name__ == "__main__":
    sys.exit(main())
