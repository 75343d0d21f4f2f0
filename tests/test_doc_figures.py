"""scripts/doc_figures.py, the check that docs/quickstart.md's figures are what its command produces: it passes when
they agree, fails naming the figure that differs, round-trips its blocks; and the page carries both blocks (the 60
rounds, the first 10 alone) and they parse. The quickstart itself is not run here: `make check-docs` runs its first
10 rounds, in CI (.ci/run), and `make check-docs-full` the 60."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent


df = load_script("doc_figures")

CLOCK = "1e10 FLOP/s per client, 10 MB/s up and 10 MB/s down per client"


def _produced(final_acc: float = 0.869) -> dict[str, str]:
    accs = [0.70, 0.84, 0.851, final_acc]
    evals = [(4 + 5 * i, {"eval/accuracy": a, "time/sim": 65.4 * (i + 1)}) for i, a in enumerate(accs)]
    final = {"eval/accuracy": final_acc, "eval/f1_macro": 0.86543, "eval/mcc": 0.85411, "eval/loss": 0.36149,
             "time/sim": 262.2}
    return df.figures(0, evals, final, CLOCK)


def _doc(figs: dict[str, str], first: dict[str, str] | None = None) -> str:
    first = first or figs
    return (f"# Page\n\nProse before.\n\n{df.render(figs)}\n\nBetween.\n\n{df.render(first, 'first-rounds')}\n\n"
            "Wall clock: 5 min 40 s (measured once).\n")


def test_figures_are_written_as_the_page_shows_them():
    f = _produced()
    assert f["accuracy"] == "86.90 %" and f["f1_macro"] == "0.8654" and f["mcc"] == "0.8541" and f["loss"] == "0.361"
    assert f["rounds"] == "20" and f["eval_rounds"] == "5 10 15 20" and f["curve"] == ".700 .840 .851 .869"
    assert f["first_target"] == "round 15, at 196 s of simulated time"
    assert f["sim_time"] == f"262 s ({CLOCK})"


def test_render_then_parse_gives_the_same_figures():
    figs = _produced()
    assert df.parse(_doc(figs)) == figs
    assert df.parse(df.render(figs)) == figs


def test_check_passes_when_the_page_agrees():
    figs = _produced()
    assert df.differences(df.parse(_doc(figs)), figs) == []


def test_check_fails_naming_the_figure_that_differs():
    doc = _doc(_produced(0.8628))
    diff = df.differences(df.parse(doc), _produced(0.8690))
    assert len(diff) == 2, diff  # the final accuracy and the curve's last point
    assert any(d.startswith("test accuracy after the last round:") and "'86.28 %'" in d and "'86.90 %'" in d
               for d in diff)
    assert any(d.startswith("accuracy at those evaluations:") for d in diff)


def test_check_fails_on_a_missing_or_unknown_row():
    figs = _produced()
    doc = _doc(figs).replace(f"| MCC after the last round | {figs['mcc']} |\n", "")
    doc = doc.replace("| seed | 0 |", "| seed | 0 |\n| best accuracy | 87.00 % |")
    diff = df.differences(df.parse(doc), figs)
    assert any(d.startswith("MCC after the last round: not on the page") for d in diff), diff
    assert any(d.startswith("best accuracy: on the page") for d in diff), diff


def test_main_check_exits_nonzero_naming_the_figure(tmp_path, monkeypatch, capsys):
    """--check runs the first rounds alone against their block, --check --full the whole run against the 60-round
    block: each fails naming the figure of its own block; a rewrite fills both blocks from their own runs."""
    page = tmp_path / "page.md"
    page.write_text(_doc(_produced(0.8628), _produced(0.7890)))
    asked = []

    def produce(config, rounds=None, speed=None):
        asked.append(rounds)
        if speed is not None:
            speed["s_per_round"] = 2.5
        return _produced(0.8690 if rounds is None else 0.7891)

    monkeypatch.setattr(df, "produce", produce)
    times = tmp_path / "times"
    assert df.main(["--check", "--doc", str(page), "--times", str(times)]) == 1 and asked == [df.FIRST_ROUNDS]
    err = capsys.readouterr().err
    assert "first-rounds block" in err and "documented '78.90 %', produced '78.91 %'" in err, err
    assert times.read_text() == "quickstart 2.50\n"
    assert df.main(["--check", "--full", "--doc", str(page)]) == 1 and asked[-1] is None
    assert "test accuracy after the last round: documented '86.28 %', produced '86.90 %'" in capsys.readouterr().err
    assert df.main(["--doc", str(page)]) == 0  # regenerate: prose and wall clock stay, both blocks are rewritten
    text = page.read_text()
    assert "Prose before." in text and "Between." in text and "Wall clock: 5 min 40 s (measured once)." in text
    assert df.parse(text)["accuracy"] == "86.90 %" and df.parse(text, "first-rounds")["accuracy"] == "78.91 %"
    assert df.main(["--check", "--doc", str(page)]) == 0
    assert df.main(["--check", "--full", "--doc", str(page)]) == 0


def test_a_page_without_exactly_one_block_is_refused():
    with pytest.raises(ValueError, match="exactly one"):
        df.parse("# no block here\n")
    with pytest.raises(ValueError, match="exactly one"):
        df.parse(_doc(_produced()) + _doc(_produced()))


def test_quickstart_page_carries_the_generated_blocks():
    doc = (ROOT / "docs" / "quickstart.md").read_text()
    assert doc.count("<!-- figures:begin") == 1 and doc.count(df.END) == 1
    first = df.parse(doc, "first-rounds")  # what CI checks: the same config's first rounds alone
    assert list(first) == [k for k, _ in df.FIGURES] and first["rounds"] == str(df.FIRST_ROUNDS), first
    assert first["eval_rounds"] == " ".join(str(r) for r in range(5, df.FIRST_ROUNDS + 1, 5))
    assert first["machine"] == df.parse(doc)["machine"]  # both blocks made on one machine kind
    figs = df.parse(doc)
    assert list(figs) == [k for k, _ in df.FIGURES], figs  # every figure, no stray row
    assert figs["seed"] == "0" and figs["rounds"] == "60"
    assert float(figs["accuracy"].removesuffix(" %")) > 80
    evals = figs["eval_rounds"].split()
    assert evals == [str(r) for r in range(5, 61, 5)] and len(figs["curve"].split()) == len(evals)
    assert figs["first_target"] == "none" or figs["first_target"].startswith("round ")
    # the wall-clock timings stay outside the checked block
    block = doc[doc.index("<!-- figures:begin"):doc.index(df.END)]
    assert "min" not in block


def test_on_another_machine_kind_learned_figures_are_checked_within_bounds():
    """Float sums round differently on another CPU or kernel set: within TOLERANCE passes, beyond it fails naming
    the figure; arithmetic figures stay exact; on the same machine kind every digit counts."""
    page = _produced(0.8628)
    there = dict(page, machine="Other CPU, AVX512")
    assert df.differences(page, dict(there)) == []  # 86.28 % written, nothing produced differs but the machine
    near = dict(_produced(0.8620), machine="Other CPU, AVX512")  # 0.08 pp: the gap measured between two machines
    assert df.differences(page, near) == []
    assert df.differences(page, dict(_produced(0.8620), machine=page["machine"]))  # same kind: exact
    far = dict(_produced(0.8228), machine="Other CPU, AVX512")  # 4 pp: beyond the final +-1 pp and the curve's +-0.03
    diff = df.differences(page, far)
    assert any(d.startswith("test accuracy after the last round:") and "beyond +-1" in d for d in diff), diff
    assert any(d.startswith("accuracy at those evaluations:") for d in diff), diff
    shifted = dict(there, sim_time="263 s (" + CLOCK + ")")
    assert [d.split(":")[0] for d in df.differences(page, shifted)] == ["simulated time of the whole run"]


def test_the_page_names_the_machine_kind_it_was_made_on():
    """The block names the CPU, torch's kernel set and the torch threads per actor the run resolved (the thread
    count splits CPU sums, so it is part of the machine kind)."""
    written = df.parse((ROOT / "docs" / "quickstart.md").read_text())["machine"]
    _, kernels, threads = written.rsplit(", ", 2)
    assert kernels in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256", "NO AVX"}
    assert re.fullmatch(r"\d+ torch threads?", threads), threads
    assert ", " in df.machine()
    assert df.figures(0, [], {"eval/accuracy": 0.5, "eval/f1_macro": 0.5, "eval/mcc": 0.5, "eval/loss": 1.0,
                              "time/sim": 1.0}, CLOCK, "4")["machine"].endswith(", 4 torch threads")


def test_a_page_made_with_a_narrower_kernel_set_is_checked_with_it_pinned(monkeypatch):
    """An AVX2 page checked on an AVX-512 CPU runs pinned to AVX2 (torch, oneDNN and MKL: devices.KERNEL_ENV), the
    kernel set being what moved the quickstart's first-rounds loss by .034, past its tolerance (docs/reliability.md);
    nothing is pinned for the same or a wider kernel set, nor where the environment already pins one."""
    import torch

    from raysplit.runtime.devices import KERNEL_ENV

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    env = df.pinned_env("AMD EPYC, AVX2, 1 torch thread")
    assert env is not None and all(env[k] == v for k, v in KERNEL_ENV["AVX2"].items())
    assert df.pinned_env("AMD EPYC, AVX512, 1 torch thread") is None and df.pinned_env(None) is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert df.pinned_env("Intel Xeon, AVX2, 1 torch thread") is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert df.pinned_env("AMD EPYC, AVX2, 1 torch thread") is None


def test_a_pinned_kernel_set_is_named_as_lowered_in_the_cpu_kind():
    """cpu_kind() (stamps, resolved.cpu, the page's "made on") says when the environment lowered torch's kernel set
    below the CPU's own, so a pinned run is never taken for one of the narrower machine kind."""
    import subprocess
    import sys

    from raysplit.runtime.devices import native_capability

    native = native_capability()
    if native in (None, "DEFAULT"):
        pytest.skip("this CPU has no kernel set wider than the default")
    code = "from raysplit.runtime.devices import cpu_kind; print(cpu_kind())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                         capture_output=True, text=True, timeout=120).stdout.strip()
    assert out.endswith(f", DEFAULT (lowered from {native})"), out
