"""The GPU machine's command cannot rot: benchmarks/bench_gpu.py's dry run (every arm on the CPU at toy size) runs
here and writes each arm's JSON with a round time for each run that exists; an arm that fails is recorded and the
next one runs; each arm's file is there as soon as the arm is done; a CUDA run on a machine without CUDA stops
after preflight.json says so. (``make rehearse-gpu`` runs the same through benchmarks/gpu_run.sh from the wheel
bundle in a bare venv.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_gpu

    return bench_gpu


def test_the_gpu_benchmarks_dry_run_times_every_arm(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "bench_gpu.py", "--dry-run", "--preflight", "--out-dir", str(out)],
                       cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{arm}.json" for arm in (
        "preflight", "plain", "local", "packed", "clients-gpu", "gas"))
    res = {arm: json.loads((out / f"{arm}.json").read_text())["results"] for arm in
           ("plain", "local", "packed", "clients-gpu", "gas")}
    for alg in ("sflv2", "sflv1"):
        for arm in ("clients-gpu", "local", "plain"):
            assert res[arm][alg]["round_s"]["median"] > 0, (alg, arm, res)
    assert res["packed"]["sflv1"]["round_s"]["median"] > 0 and res["packed"]["sflv1"]["packed_steps"] > 0
    assert res["local"]["sflv1"]["packed_steps"] == 0  # SFLV1 unpacked
    assert "nothing to pack" in res["packed"]["sflv2"]["not_applicable"]
    for arm in ("local", "packed", "plain"):  # FedAvg: one client at a time, packed, and its plain loop
        assert res[arm]["fedavg"]["round_s"]["median"] > 0, (arm, res)
    assert "fedavg" not in res["clients-gpu"] and res["gas"]["raysplit"]["round_s"]["median"] > 0
    pre = json.loads((out / "preflight.json").read_text())
    assert pre["info"]["ray"] and pre["info"]["cuda_available"] is False
    assert set(pre["results"]) == {"plain", "local", "packed", "clients-gpu", "gas"}
    assert "| packed/sflv1 |" in r.stdout
    check = subprocess.run([sys.executable, "bench_gpu.py", "--dry-run", "--check", str(out)],
                           cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300, env=env)
    assert check.returncode == 0 and "holds every arm's runs" in check.stdout, check.stdout + check.stderr[-2000:]


def test_a_failing_arm_is_recorded_and_each_arm_is_written_as_it_finishes(bench, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_plain, real_raysplit = bench.plain_arm, bench.raysplit_arm
    seen = []

    def plain(alg, a):
        if alg == "sflv2":
            raise RuntimeError("CUDA error: an illegal memory access (made up)")
        return real_plain(alg, a)

    def raysplit(alg, arm, a):  # the plain arm's file is complete before the local arm starts
        seen.append(json.loads((out / "plain.json").read_text())["results"])
        return real_raysplit(alg, arm, a)

    monkeypatch.setattr(bench, "plain_arm", plain)
    monkeypatch.setattr(bench, "raysplit_arm", raysplit)
    assert bench.main(["--dry-run", "--arms", "plain", "local", "--algorithms", "sflv1", "sflv2", "--no-gas",
                       "--out-dir", str(out)]) == 0
    plain_res = json.loads((out / "plain.json").read_text())["results"]
    assert "illegal memory access" in plain_res["sflv2"]["error"] and "RuntimeError" in plain_res["sflv2"]["traceback"]
    assert plain_res["sflv1"]["round_s"]["median"] > 0
    assert seen and set(seen[0]) == {"sflv1", "sflv2"}
    local = json.loads((out / "local.json").read_text())["results"]
    assert local["sflv1"]["round_s"]["median"] > 0 and local["sflv2"]["round_s"]["median"] > 0
    a = bench.argparse.Namespace(arms=["plain", "local"], algorithms=["sflv1", "sflv2"], gas=False)
    problems = bench.check(out, a)
    assert any("plain/sflv2: RuntimeError" in p for p in problems) and "preflight.json missing" in problems


def test_a_cuda_run_without_cuda_stops_after_the_preflight_says_so(bench, tmp_path):
    if bench.torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "out"
    assert bench.main(["--preflight", "--arms", "plain", "--out-dir", str(out)]) == 3
    pre = json.loads((out / "preflight.json").read_text())
    assert "no CUDA device" in pre["results"]["cuda"]["error"] and pre["info"]["torch"]
    assert [p.name for p in out.iterdir()] == ["preflight.json"]
