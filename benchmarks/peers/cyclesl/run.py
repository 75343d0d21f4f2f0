"""Parity runner: CycleSL's own code (AnonymWriter/CycleSL) on raysplit's Fashion-MNIST setting.

Runs THEIR ``main.py`` (``-SL SFLV2``, ``CycleSFL``, ``CyclePSL`` or ``CycleSGLR``) from a temporary copy of the
seven Python files of their checkout's HEAD, with the listed edits (edits.diff, README.md) applied to the copy,
raysplit's ``cnn_small`` supplied in their model format (shim/parity_models.py), and raysplit's client partition
(train and test indices per client) and client-sampling stream for the seed passed in. Their checkout stays
pristine; nothing of theirs is copied into this repository.

    .venv/bin/python benchmarks/peers/cyclesl/run.py --cyclesl /work/peers/CycleSL --algo CycleSFL --seed 0

Writes ``benchmarks/peers/cyclesl/.runs/<algo>_E<E>_s<seed>_r<rounds>[_theirsampling].json`` (their own per-round
evaluation, raysplit's final measure computed from their models every ``--eval-every`` rounds, wall times, the
commands, their commit) and their stdout next to it; a run whose JSON exists is skipped (``--force`` reruns it).
See README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]  # the raysplit checkout
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))
from peer_data import fmnist_raw  # noqa: E402

THEIR_FILES = ("main.py", "utils.py", "sl.py", "client.py", "server.py", "models.py", "data_preprocessing.py")
# their algorithms whose trained server is the `server` main.py passes in (the driver evaluates that one); PSL,
# SFLV1, SGLR and FedAvg train deep copies inside the loop (sl.py), which the driver cannot reach without an edit
ALGOS = {"SFLV2": "sflv2", "CycleSFL": "cyclesfl", "CyclePSL": "cyclepsl", "CycleSGLR": "cyclesglr"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cyclesl", required=True, help="a checkout of AnonymWriter/CycleSL (outside the project); its "
                   "HEAD commit is what runs")
    p.add_argument("--algo", choices=sorted(ALGOS), required=True, help="their -SL")
    p.add_argument("--server-epochs", type=int, default=1, help="their -E (the Cycle variants' E); default 1")
    p.add_argument("--seed", type=int, default=0, help="raysplit seed: partition, test splits, sampling stream; "
                   "also their -seed (their main seeds random/numpy/torch with it)")
    p.add_argument("--rounds", type=int, default=None, help="their -T; default: the config's train.rounds (300)")
    p.add_argument("--config", default=str(ROOT / "configs/cyclesl/fmnist.yaml"), help="raysplit config the "
                   "setting is read from")
    p.add_argument("--sampling", choices=["raysplit", "theirs"], default="raysplit",
                   help="raysplit: the clients of each round from raysplit's sampling stream for the seed (edit E4); "
                   "theirs: their own np.random.choice draw")
    p.add_argument("--eval-every", type=int, default=50, help="rounds between all-clients evaluations (raysplit's "
                   "eval.every); the last round is always evaluated")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=str(HERE / ".runs"), help="result folder")
    p.add_argument("--tag", default="", help="appended to the result's file name")
    p.add_argument("--force", action="store_true", help="run even if the result JSON exists")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary copy of their repository")
    return p.parse_args(argv)


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def run_name(algo: str, E: int, seed: int, rounds: int, sampling: str = "raysplit", tag: str = "") -> str:
    """The cache name of a run (docs/results/run_peers.py reads it)."""
    return (f"{ALGOS[algo]}_E{E}_s{seed}_r{rounds}" + ("_theirsampling" if sampling == "theirs" else "")
            + (f"_{tag}" if tag else ""))


def raysplit_setting(config: str, seed: int, rounds: int | None) -> dict:
    """raysplit's own data path for this config and seed: every client's train and test indices (into the
    Fashion-MNIST training file, which their loader reads whole), the sampling stream, the cut index and the
    training values, and client 0's data checksum for the driver."""

    from raysplit.algorithms.base import clients_per_round
    from raysplit.config import load_config
    from raysplit.data import load_partitioned, to_tensor
    from raysplit.experiment import sample_stream
    from raysplit.models import build_model

    cfg = load_config(config, [f"seed={seed}"] + ([f"train.rounds={rounds}"] if rounds else []))
    d, t = cfg.data, cfg.train
    if d.dataset != "fashion_mnist" or d.partition.name == "natural" or d.max_train_samples or d.n_labeled:
        raise SystemExit(f"{config}: the runner supports fashion_mnist, a non-natural partition, no "
                         "max_train_samples and no n_labeled only")
    opt = t.optimizer
    if opt.name != "adam" or opt.weight_decay or opt.decay != 1.0:
        raise SystemExit("the runner maps train.optimizer adam (no weight decay, no decay) only: their Adam(lr)")
    if t.local_steps != 1 or t.local_epochs:
        raise SystemExit("their round is one batch per sampled client: train.local_steps 1 only")
    if t.aggregation.weights != "samples" or t.aggregation.write_to != "all":
        raise SystemExit("their FedAvg weights by client train size and writes to all clients "
                         "(train.aggregation weights samples, write_to all)")
    if cfg.eval.mode != "clients" or cfg.eval.clients != "all":
        raise SystemExit("the measure compared is eval.mode clients, clients all")
    spec, (x_tr, y_tr, _, _), train_idx, test_idx, _, prov = load_partitioned(d, cfg.seed)
    m = clients_per_round(cfg)
    stream = sample_stream(cfg.seed, len(train_idx), m, t.rounds)
    model = build_model(cfg.model.name, spec.num_classes, spec.input_shape)
    cut = model.resolve_cut(cfg.model.cut)
    x0 = to_tensor(x_tr[train_idx[0]], spec)
    sbs = getattr(cfg.algorithm, "server_batch_size", None)
    return {"train": [[int(i) for i in p] for p in train_idx], "test": [[int(i) for i in p] for p in test_idx],
            "samples": stream.tolist(), "files": prov["files"], "num_clients": len(train_idx),
            "per_round": int(m), "rounds": int(t.rounds), "batch_size": int(t.batch_size),
            "server_batch_size": int(sbs or t.batch_size), "lr": float(opt.lr), "model": cfg.model.name,
            "cut": int(cut), "cut_name": str(cfg.model.cut), "test_fraction": d.test_fraction,
            "partition": prov["partition"], "eval_every": int(cfg.eval.every),
            "check": {"x_sum": float(x0.double().sum()), "y_sum": int(np.asarray(y_tr)[train_idx[0]].sum()),
                      "n": int(len(train_idx[0])), "num_clients": len(train_idx)}}


def prepare_copy(repo: Path, commit: str) -> Path:
    """Their seven Python files at ``commit`` (``git show``: the snapshot lacks some large blobs, so ``git
    archive`` of the whole tree fails), line endings CRLF -> LF (theirs are CRLF; edits.diff is LF), edits.diff
    applied, the shims added."""
    tmp = Path(tempfile.mkdtemp(prefix="cyclesl_parity_"))
    for f in THEIR_FILES:
        src = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{f}"], check=True, capture_output=True).stdout
        (tmp / f).write_bytes(src.replace(b"\r\n", b"\n"))
    r = subprocess.run(["patch", "-p1", "--batch", "--forward", "-d", str(tmp), "-i", str(HERE / "edits.diff")],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"edits.diff does not apply to {repo} at {commit}:\n{r.stdout}{r.stderr}")
    for f in (HERE / "shim").glob("*.py"):
        shutil.copy(f, tmp / f.name)
    return tmp


def main(argv=None) -> int:
    a = parse_args(argv)
    repo = Path(a.cyclesl).resolve()
    if str(repo).startswith(str(ROOT) + os.sep):
        raise SystemExit("--cyclesl must be a checkout outside the project (their code is not copied into it)")
    commit = git(repo, "rev-parse", "HEAD")
    dirty = git(repo, "status", "--porcelain", "--", *THEIR_FILES)  # their checkout's other files do not run

    st = raysplit_setting(a.config, a.seed, a.rounds)
    rounds = st["rounds"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = run_name(a.algo, a.server_epochs, a.seed, rounds, a.sampling, a.tag)
    if (out / f"{name}.json").is_file() and not a.force:
        print(f"cached: {out / (name + '.json')} (--force reruns it)")
        return 0

    data_root = fmnist_raw(st["files"], "cyclesl_parity_data")
    tmp = prepare_copy(repo, commit)
    (tmp / "parity_partition.json").write_text(json.dumps({"train": st["train"], "test": st["test"]}))
    (tmp / "parity_check.json").write_text(json.dumps(st["check"]))
    env = dict(os.environ, PYTHONHASHSEED=str(a.seed), TQDM_DISABLE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                          else [])))
    env.pop("CYCLESL_PARITY_SAMPLES", None)
    if a.sampling == "raysplit":
        (tmp / "parity_samples.json").write_text(json.dumps(st["samples"]))
        env["CYCLESL_PARITY_SAMPLES"] = str(tmp / "parity_samples.json")
    if a.threads > 0:
        env["OMP_NUM_THREADS"] = str(a.threads)
    lr = repr(st["lr"])
    their = ["-P", "fmnist", "-SL", a.algo, "-seed", str(a.seed), "-device", "-1", "-T", str(rounds),
             "-E", str(a.server_epochs), "-C", str(st["per_round"]), "-K", "1.0", "-S", "1",
             "-c_bs", str(st["batch_size"]), "-s_bs", str(st["server_batch_size"]), "-c_lr", lr, "-s_lr", lr,
             "-c_op", "Adam", "-s_op", "Adam", "-L", str(st["cut"]), "--no-default",
             "--fmnist_path", str(data_root), "--fmnist_partition_path", str(tmp / "parity_partition.json")]
    raw_json = tmp / "parity_result.json"
    cmd = [sys.executable, str(HERE / "_driver.py"), str(a.threads), str(a.eval_every), str(raw_json),
           str(tmp / "parity_check.json"), *their]
    print(f"their commit {commit[:10]}, copy {tmp}\n  python main.py {' '.join(their)}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed runner stops their script too (finally)
    t0 = time.time()
    proc = None
    try:
        with open(out / f"{name}.stdout", "w") as so:
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:
                so.write(line)
                if line.startswith("round "):
                    print(line, end="", flush=True)
            rc = proc.wait()
        raw = json.loads(raw_json.read_text()) if raw_json.is_file() else {}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if not a.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    wall = time.time() - t0

    logs, eva = raw.get("their_logs", []), raw.get("all_clients", [])
    times = raw.get("log_times_s", [])
    per_round = np.diff(times[1:]) if len(times) > 2 else []
    final = eva[-1] if eva and eva[-1]["round"] == rounds else None
    result = {
        "runner_command": [sys.executable, *sys.argv] if argv is None else ["run.py", *argv],
        "their_repo": str(repo), "their_commit": commit, "their_checkout_dirty": bool(dirty),
        "their_command": ["python", "main.py", *their],
        "driver": "torch threads; wandb stand-in (shim/wandb.py); the -SL function wrapped to evaluate every "
                  "client's test split with their model_eval every --eval-every rounds (RNG state preserved)",
        "edits_sha256": hashlib.sha256((HERE / "edits.diff").read_bytes()).hexdigest(),
        "algo": a.algo, "server_epochs": a.server_epochs, "seed": a.seed, "rounds": rounds, "sampling": a.sampling,
        "raysplit_config": a.config,
        "setting": {k: st[k] for k in ("num_clients", "per_round", "batch_size", "server_batch_size", "lr", "model",
                                       "cut", "cut_name", "test_fraction", "partition")} | {"threads": a.threads},
        "client_train_sizes": raw.get("client_train_sizes"), "client_test_sizes": raw.get("client_test_sizes"),
        "data_check": raw.get("data_check"),
        "returncode": rc, "rounds_completed": max(0, len(logs) - 1),
        # raysplit's measure from their models: every client's test split through its own client model
        "curve": [(e["round"], e["all/accu"]) for e in eva], "all_clients": eva,
        "final_accuracy": final["all/accu"] if final else None,
        "final_f1_macro": final["all/f1"] if final else None, "final_mcc": final["all/mcc"] if final else None,
        # their own evaluation (the test splits of the round's sampled clients), before training and per round
        "their_eval_initial": logs[0] if logs else None,
        "their_eval_last_round": logs[-1] if len(logs) > 1 else None,
        "their_accuracy_per_round": [r.get("test/accu") for r in logs[1:]],
        "wall_time_s": round(wall, 1), "train_wall_s": raw.get("train_wall_s"),
        "wall_s_per_round_median": float(np.median(per_round)) if len(per_round) else None,
        "files": {"stdout": f"{name}.stdout"},
    }
    if rc == 0 and final is not None:
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        print(f"final accuracy (all clients' test splits) {result['final_accuracy']:.4f}; their last-round "
              f"evaluation {result['their_eval_last_round'].get('test/accu'):.4f}; wall {wall:.1f} s "
              f"({result['wall_s_per_round_median']:.3f} s a round)\n-> {out / (name + '.json')}")
        return 0
    (out / f"{name}.failed.json").write_text(json.dumps(result, indent=1))
    print((out / f"{name}.stdout").read_text()[-3000:], file=sys.stderr)
    return rc or 1


if __name__ == "__main__":
    sys.exit(main())
