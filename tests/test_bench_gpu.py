"""``make bench-gpu``'s script cannot rot: its dry run (every arm on the CPU at toy size) runs here and writes
its JSON with a round time for each arm that exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_benchmarks_dry_run_times_every_arm(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench_gpu.py", "--dry-run", "--out", "bench-gpu-test"],
                       cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = json.loads((ROOT / "benchmarks" / "out" / "bench-gpu-test-dry-run.json").read_text())
    res = out["results"]
    for alg in ("sflv2", "sflv1"):
        for arm in ("server-gpu", "clients-gpu", "local", "plain"):
            assert res[f"{alg}/{arm}"]["round_s"]["median"] > 0, (alg, arm, res)
    assert res["sflv1/packed"]["round_s"]["median"] > 0 and "nothing to pack" in res["sflv2/packed"]["not_applicable"]
    for arm in ("local", "packed", "plain"):  # FedAvg: one client at a time, packed, and its plain loop
        assert res[f"fedavg/{arm}"]["round_s"]["median"] > 0, (arm, res)
    assert "fedavg/server-gpu" not in res and res["gas/raysplit"]["round_s"]["median"] > 0
    assert "| sflv1/clients-gpu |" in r.stdout and out["args"]["device"] == "cpu"
