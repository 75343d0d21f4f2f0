"""Wall time per global round: raysplit's GAS against the authors' published code (eejiarong/GAS), same machine,
same setting (Fashion-MNIST, shards 2, 20 clients, 10 active, 20 local iterations, AlexNet split at L2, full
covariance), measured in one run of this script.

    .venv/bin/python benchmarks/gas_vs_authors.py --authors /path/to/eejiarong/GAS [--rounds 4] [--out OUT.json]

The authors' code is never copied into this repository: the script copies the given checkout to a temporary
folder, sets its flags for this setting by editing the module-level globals it is configured by (``cifar`` ->
``fmnist``, ``epochs`` -> ``--rounds``, ``Accu_Test_Frequency`` -> never, so neither side spends time testing),
adds one line that prints a timestamp whenever a global round ends, and points its data root at a folder holding
the Debian package's Fashion-MNIST files extracted under ``FashionMNIST/raw/`` (benchmarks/peers/peer_data.py,
shared with the parity runner benchmarks/peers/gas/run.py). Its device is CUDA if available,
else CPU (as it is written), with torch's default threads. The first round of each side (start-up, first FLOP
counts) is reported but left out of the median.

raysplit runs ``configs/gas/fmnist.yaml`` with each covariance kind (full, diagonal, lowrank), evaluation off
until the last round, on the local backend with 2 torch threads (one process, as the authors' code) and on the
Ray backend (the server actor and two client actors). Where the authors' code cannot run, the script says why
and times a plain reimplementation of its sampling step instead (``MultivariateNormal`` rebuilt per label per
server update on the same statistics).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FMNIST = Path("/usr/share/datasets/fashion-mnist")
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
from peer_data import gas_data, gas_env  # noqa: E402  (shared with benchmarks/peers/gas/run.py)


def prepare_authors(src: Path, rounds: int, work: Path, test_every: int | None = None) -> Path:
    """A copy of the authors' checkout set for this setting (``test_every``: test every that many rounds, as
    ``Accu_Test_Frequency``; None: never)."""
    code = work / "GAS"
    shutil.copytree(src, code, ignore=shutil.ignore_patterns(".git"))
    gas_data(code, [str(f) for f in FMNIST.glob("*.gz")])  # work/data -> the unpacked files
    main = code / "GAS_main.py"
    text = main.read_text()
    edits = [(r"^cifar = True", "cifar = False"), (r"^fmnist = False", "fmnist = True"),
             (r"^epochs = \d+", f"epochs = {rounds}"),
             (r"^Accu_Test_Frequency = \d+", f"Accu_Test_Frequency = {test_every or 10**9}"),
             (r"^(\s+)epoch \+= 1$",
              r"\1epoch += 1\n\1print('RAYSPLIT_ROUND_DONE', epoch, __import__('time').time(), local_epoch, flush=True)")]
    for pattern, repl in edits:
        text, n = re.subn(pattern, repl, text, count=1, flags=re.M)
        if n != 1:
            raise RuntimeError(f"could not apply {pattern!r} to GAS_main.py (the authors' code changed?)")
    main.write_text(text)
    return code


def time_authors(code: Path, timeout: float) -> tuple[list[float], list[int]]:
    """Wall time of each global round and the server updates it made (``local_epoch`` counts them)."""
    t0 = time.time()
    env = gas_env(code)  # GAS_main.py looks for utils/ beside its parent folder; the repository has it beside the script
    proc = subprocess.Popen([sys.executable, "-u", "GAS_main.py"], cwd=code, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    stamps, updates, tail = [], [], []
    for line in proc.stdout:
        tail = (tail + [line])[-30:]
        if line.startswith("RAYSPLIT_ROUND_DONE"):
            stamps.append(float(line.split()[2]))
            updates.append(int(line.split()[3]))
        if time.time() - t0 > timeout:
            proc.kill()
            break
    if proc.wait() != 0 and not stamps:
        raise RuntimeError("the authors' code failed:\n" + "".join(tail))
    return [b - a for a, b in zip([t0] + stamps, stamps)], [b - a for a, b in zip([0] + updates, updates)]


def time_raysplit(kind: str, backend: str, rounds: int, workdir: Path) -> tuple[list[float], list[int]]:
    from mlflow.tracking import MlflowClient

    from raysplit.config import load_config
    from raysplit.experiment import run_experiment

    uri = f"sqlite:///{workdir / 'bench.db'}"
    cfg = load_config(ROOT / "configs/gas/fmnist.yaml", [
        f"train.rounds={rounds}", f"eval.every={rounds}", f"algorithm.covariance={kind}", f"runtime.backend={backend}",
        "runtime.torch_threads=2" if backend == "local" else "runtime.torch_threads=1",
        f"tracking.uri={uri}", "tracking.experiment=gas-benchmark", f"tracking.output_dir={workdir / 'out'}",
        "tracking.progress=false", "tracking.checkpoint_every=0"])
    final = run_experiment(cfg)
    client = MlflowClient(uri)

    def series(key):
        return [h.value for h in sorted(client.get_metric_history(final["run_id"], key), key=lambda h: h.step)]

    return series("time/wall_round"), [int(v) for v in series("method/server_updates")]


def sampling_step_reference(rounds: int) -> dict:
    """The authors' sampling step (a MultivariateNormal per label per server update, covariance 3136 x 3136,
    jitter retries) timed on synthetic statistics: what one global round's 22 server updates cost in it."""
    import torch

    torch.manual_seed(0)
    dim, labels = 3136, 10
    a = torch.randn(dim, 64)
    cov = a @ a.T / 64 + 1e-5 * torch.eye(dim)
    t = time.perf_counter()
    for _ in range(labels):
        torch.distributions.MultivariateNormal(torch.zeros(dim), covariance_matrix=cov).sample((32,))
    per_update = time.perf_counter() - t
    return {"per_server_update_s": per_update, "per_round_s (22 updates)": 22 * per_update}


def summary(measured: tuple[list[float], list[int]]) -> dict:
    """Per-round wall times (the first round left out: start-up), their median, and the time per server update
    (one activation buffer: 10 client iterations and a server step), which does not depend on how many buffers a
    round happens to take."""
    times, updates = measured
    rest, ups = (times[1:], updates[1:]) if len(times) > 1 else (times, updates)
    return {"rounds": times, "server_updates": updates, "median_s": statistics.median(rest), "mean_s": statistics.mean(rest),
            "min_s": min(rest), "max_s": max(rest), "s_per_server_update": sum(rest) / max(sum(ups), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--authors", type=Path, help="a checkout of eejiarong/GAS (not part of this repository)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kinds", nargs="*", default=["full", "diagonal", "lowrank"])
    ap.add_argument("--backends", nargs="*", default=["local", "ray"])
    ap.add_argument("--authors-timeout", type=float, default=3600.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/gas_vs_authors.json")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    work = Path(tempfile.mkdtemp(prefix="gas-bench-"))
    out: dict = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}}
    if args.authors:
        try:
            code = prepare_authors(args.authors, args.rounds, work)
            out["authors"] = summary(time_authors(code, args.authors_timeout))
        except Exception as e:  # noqa: BLE001 - reported, then the reference sampling step is timed instead
            out["authors_error"] = f"{type(e).__name__}: {e}"
    if "authors" not in out:
        out["authors_sampling_step_reference"] = sampling_step_reference(args.rounds)
    for backend in args.backends:
        for kind in args.kinds:
            out[f"raysplit_{backend}_{kind}"] = summary(time_raysplit(kind, backend, args.rounds, work))
            print(kind, backend, out[f"raysplit_{backend}_{kind}"]["median_s"], flush=True)
    if "authors" in out:
        for k, v in list(out.items()):
            if k.startswith("raysplit_"):
                v["speedup_vs_authors"] = out["authors"]["s_per_server_update"] / v["s_per_server_update"]
    out["machine"]["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "rounds"})
                      for k, v in out.items()}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
