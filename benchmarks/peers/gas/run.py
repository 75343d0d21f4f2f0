"""Parity runner: GAS's own code (eejiarong/GAS, ``GAS_main.py``) beside raysplit's GAS on one reduced
Fashion-MNIST setting (benchmarks/peers/gas/raysplit.yaml: configs/gas/fmnist.yaml with 12 global rounds).

Their side runs THEIR ``GAS_main.py`` from a temporary copy of their checkout's HEAD (``git archive``) with the
edits of edits.diff (E1-E5, README.md) applied to the copy: the setting, raysplit's client partition,
normalisation, client profiles and initial weights for the seed are passed in as a JSON file, and a progress line
is printed per global round. Their checkout stays pristine; nothing of theirs is copied into this repository.
raysplit's side runs raysplit.yaml with ``seed=S`` (``--side raysplit``). Both are measured the same way: the
global client model and the server model on the 10,000 test images after every ``eval.every`` global rounds and
after the last.

    .venv/bin/python benchmarks/peers/gas/run.py --authors /work/peers/GAS --seeds 0 1 2
    .venv/bin/python benchmarks/peers/gas/run.py --side raysplit --seeds 0 1 2
    .venv/bin/python benchmarks/peers/gas/run.py --side both --authors /work/peers/GAS --seeds 0 --smoke

Writes one JSON per side and seed, ``<out>/<side>_s<seed>_r<rounds>[...].json`` (default out:
benchmarks/peers/gas/.runs), with the accuracy curve, the final accuracy, the simulated time and server updates
per round and the wall times; their stdout beside it. A run whose JSON exists is skipped (``--force`` reruns it).
``docs/results/run_peers.py gas`` tabulates them. See README.md.
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
from peer_data import gas_data, gas_env  # noqa: E402

CONFIG = HERE / "raysplit.yaml"
SMOKE_ROUNDS = 2
JITTER_MESSAGE = "not positive definite"  # their utils.try_multivariate_normal, before its jitter retries


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--authors", help="a checkout of eejiarong/GAS (outside the project); its HEAD commit is what "
                   "runs (needed for --side authors and both)")
    p.add_argument("--side", choices=["authors", "raysplit", "both"], default="authors",
                   help="whose code runs: the authors' GAS_main.py (default), raysplit's GAS, or both (one after "
                   "the other, per seed)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="raysplit seeds (partition, profiles, initial "
                   "weights); also their seed_value (E1), which seeds their torch and numpy")
    p.add_argument("--config", default=str(CONFIG), help="the raysplit config of the setting (both sides)")
    p.add_argument("--rounds", type=int, default=None, help="global rounds; default: the config's train.rounds")
    p.add_argument("--eval-every", type=int, default=None, help="rounds between evaluations (the last round is "
                   "always evaluated); default: the config's eval.every")
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROUNDS} rounds, evaluated after each (a check that "
                   "both sides run and write their cache; not a result)")
    p.add_argument("--profiles", choices=["raysplit", "theirs"], default="raysplit",
                   help="their clients' speeds and rates: raysplit's draw for the seed (E2) or their own")
    p.add_argument("--init", choices=["raysplit", "theirs"], default="raysplit",
                   help="their initial weights: raysplit's for the seed (E4) or their own torch draw")
    p.add_argument("--threads", type=int, default=1, help="torch threads of either side (0: torch's default)")
    p.add_argument("--out", default=str(HERE / ".runs"), help="result folder")
    p.add_argument("--tag", default="", help="appended to the result's file name")
    p.add_argument("--force", action="store_true", help="run even if the result JSON exists")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary copy of their repository")
    a = p.parse_args(argv)
    if a.side != "raysplit" and not a.authors:
        p.error("--authors PATH is needed for --side authors and both")
    if a.smoke:
        a.rounds = a.rounds or SMOKE_ROUNDS
        a.eval_every = a.eval_every or 1
    return a


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def run_name(side: str, seed: int, rounds: int, profiles: str = "raysplit", init: str = "raysplit",
             tag: str = "") -> str:
    """The cache name of a run (docs/results/run_peers.py gas reads it)."""
    mods = ("_theirprofiles" if side == "authors" and profiles == "theirs" else "") + (
        "_theirinit" if side == "authors" and init == "theirs" else "")
    return f"{side}_s{seed}_r{rounds}{mods}" + (f"_{tag}" if tag else "")


def load(config: str, seed: int, rounds: int | None, eval_every: int | None):
    from raysplit.config import load_config

    return load_config(config, [f"seed={seed}"] + ([f"train.rounds={rounds}"] if rounds else [])
                       + ([f"eval.every={eval_every}"] if eval_every else []))


def unmappable(cfg, prep) -> list[str]:
    """What of the raysplit config their GAS_main.py cannot be given (its values are module globals, several of
    them fixed: SGD momentum 0.9, weight decay 5e-4, clipping at 10, buffers of M, 1/M model weights, full
    covariance, logit adjustment with tau 1, recency weights, one test over the whole test set)."""
    d, t, p, alg = cfg.data, cfg.train, cfg.algorithm, prep.algorithm
    m, o = alg.event_setup.active, t.optimizer
    checks = [
        (cfg.algorithm_name == "gas", "algorithm.name gas"),
        (d.dataset == "fashion_mnist", "data.dataset fashion_mnist (their Fashion-MNIST loader)"),
        (d.partition.name != "natural" and not d.max_train_samples and not d.n_labeled and not d.test_fraction
         and not d.max_test_samples, "a partition of the whole training file, no test splits, the whole test set"),
        (cfg.model.name == "alexnet_gas" and prep.cut == 2, "model alexnet_gas cut L2 (their AlexNetDown | AlexNetUp)"),
        (p.buffer_size in (None, m) and p.model_buffer_size in (None, m), "activation and model buffers of M"),
        (p.model_weights == "uniform" and p.generate and p.covariance == "full" and p.logit_adjustment
         and p.tau == 1.0 and p.weighting == "recency" and p.min_per_label in (None, t.batch_size),
         "GAS's own rules: uniform model weights, generation to the batch size per label with a full covariance, "
         "logit adjustment tau 1, recency weights"),
        (o.name == "sgd" and o.momentum == 0.9 and o.weight_decay == 0.0005 and not o.nesterov and o.decay == 1.0
         and t.server_optimizer is None, "SGD(lr, momentum 0.9, weight decay 5e-4) on both sides, constant lr"),
        (t.clip_grad_norm == 10.0, "train.clip_grad_norm 10"),
        (not t.local_epochs and not t.drop_last, "train.local_steps iterations a job, drop_last false"),
        (cfg.eval.mode == "global", "eval.mode global"),
        (cfg.clock.profile == "gas_cell", "clock.profile gas_cell"),
    ]
    return [why for ok, why in checks if not ok]


def raysplit_setting(config: str, seed: int, rounds: int | None, eval_every: int | None) -> dict:
    """raysplit's own data path for this config and seed (raysplit.experiment.prepare, nothing trained): every
    client's training indices into the Fashion-MNIST training file, the normalisation, the clients' profiles, the
    initial client and server weights, the training values, and client 0's data checksum."""
    import torch

    from raysplit.data import to_tensor
    from raysplit.experiment import prepare

    cfg = load(config, seed, rounds, eval_every)
    prep = prepare(cfg)
    bad = unmappable(cfg, prep)
    if bad:
        raise SystemExit(f"{config}: their GAS_main.py cannot be given this setting; it needs " + "; ".join(bad))
    inp, t = prep.inputs, cfg.train
    spec = inp.spec.data_spec
    x, y, x_te = inp.train_data["x"], inp.train_data["y"], inp.test_data["x"]
    idx0 = np.asarray(inp.train_idx[0])
    init = {k: [torch.as_tensor(np.array(v)) for v in getattr(inp, f"{k}_init").values()] for k in ("client", "server")}
    return {
        "train_idx": [[int(i) for i in p] for p in inp.train_idx], "mean": list(spec.mean), "std": list(spec.std),
        "profiles": {"flops": [p.flops for p in inp.profiles], "rate_bits": [8.0 * p.up for p in inp.profiles]},
        "init_tensors": init, "rounds": int(t.rounds), "eval_every": int(cfg.eval.every),
        "local_steps": int(t.local_steps), "batch_size": int(t.batch_size), "lr": float(t.optimizer.lr),
        "num_clients": len(inp.train_idx), "active": int(prep.algorithm.event_setup.active),
        "files": prep.dataset["files"], "partition": prep.dataset["partition"], "model": cfg.model.name,
        "cut": prep.cut_name,
        "check": {"x_sum": float(to_tensor(x[idx0], spec).double().sum()), "y_sum": int(y[idx0].sum()),
                  "n": int(len(idx0)), "num_clients": len(inp.train_idx), "test_n": int(len(x_te)),
                  "test_x0_sum": float(to_tensor(x_te[:1], spec).double().sum())},
    }


def check_equal(theirs: dict, ours: dict) -> bool:
    exact = all(theirs.get(k) == ours[k] for k in ("y_sum", "n", "num_clients", "test_n"))
    return exact and all(abs(theirs.get(k, float("inf")) - ours[k]) <= 1e-4 * max(1.0, abs(ours[k]))
                         for k in ("x_sum", "test_x0_sum"))


def prepare_copy(repo: Path, commit: str) -> Path:
    """Their tree at ``commit`` (``git archive``) in a temporary folder, edits.diff applied to it, and the data
    link their loader needs beside it (peer_data.gas_data). Returns the folder of GAS_main.py."""
    tmp = Path(tempfile.mkdtemp(prefix="gas_parity_"))
    code = tmp / "GAS"
    code.mkdir()
    tar = subprocess.run(["git", "-C", str(repo), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(code)], input=tar, check=True)
    r = subprocess.run(["patch", "-p1", "--batch", "--forward", "-d", str(code), "-i", str(HERE / "edits.diff")],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"edits.diff does not apply to {repo} at {commit}:\n{r.stdout}{r.stderr}")
    return code


def summary(curve, sim, updates, walls) -> dict:
    """The fields both sides' JSON share besides the setting: the curve, the final accuracy (None if the last
    round was not evaluated), simulated time and server updates per round, wall seconds per round (round 1 includes
    the side's start-up; the median is over rounds 2..)."""
    rounds = len(updates)
    return {"curve": curve, "final_accuracy": curve[-1][1] if curve and curve[-1][0] == rounds else None,
            "rounds_completed": rounds, "sim_time": sim, "server_updates": updates,
            "wall_s_per_round": [round(w, 2) for w in walls],
            "wall_s_per_round_median": float(np.median(walls[1:] if len(walls) > 1 else walls)) if walls else None}


def run_authors(a, repo: Path, commit: str, dirty: bool, seed: int, out: Path) -> int:
    import torch

    rounds = load(a.config, seed, a.rounds, a.eval_every).train.rounds
    name = run_name("authors", seed, rounds, a.profiles, a.init, a.tag)
    if (out / f"{name}.json").is_file() and not a.force:
        print(f"cached: {out / (name + '.json')} (--force reruns it)")
        return 0
    st = raysplit_setting(a.config, seed, a.rounds, a.eval_every)
    code = prepare_copy(repo, commit)
    gas_data(code, st["files"])
    parity = {k: st[k] for k in ("rounds", "eval_every", "local_steps", "batch_size", "lr", "num_clients", "active",
                                 "train_idx", "mean", "std")} | {"seed": seed}
    if a.profiles == "raysplit":
        parity["profiles"] = st["profiles"]
    if a.init == "raysplit":
        torch.save(st["init_tensors"], code / "parity_init.pt")
        parity["init"] = str(code / "parity_init.pt")
    (code / "parity.json").write_text(json.dumps(parity))
    env = gas_env(code, GAS_PARITY=str(code / "parity.json"), PYTHONHASHSEED=str(seed))
    if a.threads > 0:
        env.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    cmd = [sys.executable, "-u", "GAS_main.py"]
    print(f"authors, seed {seed}: their commit {commit[:10]}, copy {code}, {rounds} rounds", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed runner stops their script too (finally)
    t0 = time.time()
    proc, check, evals, stamps, jitter, rc = None, None, [], [], 0, None
    t_data = None
    try:
        with open(out / f"{name}.stdout", "w") as so:
            proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            last_round = None
            for line in proc.stdout:
                so.write(line)
                if line.startswith("PARITY_CHECK "):
                    t_data = time.time()
                    got = json.loads(line.split(" ", 1)[1])
                    check = {"theirs": got, "raysplit": st["check"], "equal": check_equal(got, st["check"])}
                    if not check["equal"]:
                        proc.kill()
                        print(f"their client 0's data or test set differs from raysplit's: {check}", file=sys.stderr)
                elif line.startswith("PARITY_ROUND "):
                    _, rnd, stamp, updates, sim = line.split()
                    stamps.append((int(rnd), float(stamp), int(updates), float(sim)))
                    print(f"  round {rnd}: {float(stamp) - (stamps[-2][1] if len(stamps) > 1 else t_data or t0):.1f} s, "
                          f"{updates} server updates so far", flush=True)
                elif line.startswith("Global iteration: "):
                    last_round = int(line.split(":")[1])
                elif line.startswith("Accuracy: ") and last_round is not None:
                    evals.append([last_round, float(line.split(":")[1])])
                    print(f"  round {last_round}: test accuracy {evals[-1][1]:.4f}", flush=True)
                elif JITTER_MESSAGE in line:
                    jitter += 1
            rc = proc.wait()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if not a.keep_tmp:
            shutil.rmtree(code.parent, ignore_errors=True)
    wall = time.time() - t0
    ends = [s[1] for s in stamps]
    walls = [b - a_ for a_, b in zip([t_data or t0] + ends, ends)]
    ups = [s[2] for s in stamps]
    result = {
        "side": "authors", "seed": seed, "rounds": rounds, "eval_every": st["eval_every"],
        "runner_command": [sys.executable, *sys.argv],
        "their_repo": str(repo), "their_commit": commit, "their_checkout_dirty": dirty,
        "their_command": ["python", "-u", "GAS_main.py"], "their_env": {"GAS_PARITY": "parity.json"},
        "edits_sha256": hashlib.sha256((HERE / "edits.diff").read_bytes()).hexdigest(),
        "profiles": a.profiles, "init": a.init, "raysplit_config": a.config, "threads": a.threads,
        "setting": {k: st[k] for k in ("num_clients", "active", "local_steps", "batch_size", "lr", "model", "cut",
                                       "partition", "mean", "std")},
        "data_check": check, "returncode": rc,
        **summary(evals, [[s[0], s[3]] for s in stamps], [b - a_ for a_, b in zip([0] + ups, ups)], walls),
        "jitter_retries": jitter, "wall_time_s": round(wall, 1), "files": {"stdout": f"{name}.stdout"},
    }
    ok = rc == 0 and check and check["equal"] and result["final_accuracy"] is not None
    return write(out, name, result, ok)


def run_raysplit(a, seed: int, out: Path) -> int:
    import raysplit

    cfg = load(a.config, seed, a.rounds, a.eval_every)
    rounds = cfg.train.rounds
    name = run_name("raysplit", seed, rounds, tag=a.tag)
    if (out / f"{name}.json").is_file() and not a.force:
        print(f"cached: {out / (name + '.json')} (--force reruns it)")
        return 0
    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    overrides = {"seed": seed, "train.rounds": rounds, "eval.every": cfg.eval.every,
                 "runtime.torch_threads": a.threads if a.threads > 0 else None, "tracking.uri": uri,
                 "tracking.output_dir": str((out / "outputs").resolve()), "tracking.progress": False,
                 "tracking.run_name": name}
    print(f"raysplit, seed {seed}: {a.config} with {overrides}", flush=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cwd, t0 = os.getcwd(), time.time()
    os.chdir(out)  # a sqlite store's artifacts go to ./mlruns: here, beside the runs
    try:
        res = raysplit.run(str(Path(cwd, a.config).resolve()), overrides)
    finally:
        os.chdir(cwd)
    wall = time.time() - t0
    df = res.rounds

    def col(key):
        return [[int(r), float(v)] for r, v in df[key].dropna().items()] if key in df else []

    curve = col("eval/accuracy")
    for r, acc in curve:
        print(f"  round {r}: test accuracy {acc:.4f}", flush=True)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "raysplit"], capture_output=True,
                           text=True).stdout.strip()
    result = {
        "side": "raysplit", "seed": seed, "rounds": rounds, "eval_every": cfg.eval.every,
        "runner_command": [sys.executable, *sys.argv], "raysplit_config": a.config, "overrides": overrides,
        "raysplit_commit": head, "raysplit_dirty": bool(dirty), "run_id": res.run_id, "tracking_uri": uri,
        "threads": a.threads, "returncode": 0,
        **summary(curve, col("time/sim"), [int(v) for _, v in col("method/server_updates")],
                  [v for _, v in col("time/wall_round")]),
        "generated_activations": [int(v) for _, v in col("method/generated_activations")],
        "wall_time_s": round(wall, 1),
    }
    return write(out, name, result, result["final_accuracy"] is not None)


def write(out: Path, name: str, result: dict, ok: bool) -> int:
    if ok:
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        print(f"{result['side']}, seed {result['seed']}: final accuracy {result['final_accuracy']:.4f} at round "
              f"{result['rounds']}; wall {result['wall_time_s']:.0f} s ({result['wall_s_per_round_median']:.1f} s a "
              f"round, median of rounds 2..)\n-> {out / (name + '.json')}", flush=True)
        return 0
    (out / f"{name}.failed.json").write_text(json.dumps(result, indent=1))
    so = out / f"{name}.stdout"
    if so.is_file():
        print(so.read_text()[-3000:], file=sys.stderr)
    print(f"{result['side']}, seed {result['seed']}: failed -> {out / (name + '.failed.json')}", file=sys.stderr)
    return result.get("returncode") or 1


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    repo = commit = dirty = None
    if a.side != "raysplit":
        repo = Path(a.authors).resolve()
        if str(repo).startswith(str(ROOT) + os.sep):
            raise SystemExit("--authors must be a checkout outside the project (their code is not copied into it)")
        commit = git(repo, "rev-parse", "HEAD")
        dirty = bool(git(repo, "status", "--porcelain"))  # git archive runs the commit, not the work tree
    rc = 0
    for seed in a.seeds:
        if a.side in ("authors", "both"):
            rc = run_authors(a, repo, commit, dirty, seed, out) or rc
        if a.side in ("raysplit", "both"):
            rc = run_raysplit(a, seed, out) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
