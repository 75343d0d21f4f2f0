"""Runs CycleSL's ``main.py`` unchanged, as ``python main.py ARGS`` would, and measures raysplit's final metric from
their models. Started by run.py with the temporary copy of their repository as the working directory.

    python _driver.py THREADS EVAL_EVERY OUT_JSON CHECK_JSON [their main.py args...]

What it adds around their run (none of it changes their training):

* torch threads (``THREADS``; their code sets none).
* ``wandb`` is the stand-in shim/wandb.py (copied next to main.py), which keeps every dict their ``eval_help`` logs:
  their own evaluation, once before training and once after every round, on the test splits of that round's
  sampled clients.
* The algorithm function that main.py calls (``-SL``) is wrapped: the wrapper keeps ``clients`` and ``server`` and
  checks client 0's data against raysplit's (``CHECK_JSON``: the sums of its normalised training images and labels,
  computed by run.py with raysplit's loader). Every ``EVAL_EVERY`` rounds and after the last round their own
  ``models.model_eval`` runs over **every** client's test split, each through its own client model and the server
  (raysplit's ``eval.mode: clients, clients: all``). That evaluation iterates their shuffled test loaders, which
  draws from torch's global generator; it runs inside ``torch.random.fork_rng`` so the training draws are the same
  as without it.
* Their main seeds ``random``, numpy and torch with ``-seed`` itself (utils.seed).

Writes ``OUT_JSON``: their logged rows with the time each was logged, the all-clients evaluations, the data check.
"""

import json
import os
import runpy
import sys
import time

import torch

threads, every, out_json, check_json, args = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                              sys.argv[5:])
if threads > 0:
    torch.set_num_threads(threads)
sys.path.insert(0, os.getcwd())

import models  # noqa: E402  (theirs, from the working directory)
import sl  # noqa: E402
import wandb  # noqa: E402  (shim/wandb.py)

assert getattr(wandb, "LOGS", None) is not None, "wandb is not the runner's stand-in (shim/wandb.py)"
algo = args[args.index("-SL") + 1]
rounds = int(args[args.index("-T") + 1])
check = json.loads(open(check_json).read())
state = {"t0": time.time(), "times": [], "all_clients": [], "data_check": None}


def all_clients_eval(rnd: int) -> None:
    """Their model_eval over every client's test split (raysplit's final measure), RNG state preserved."""
    row = {}
    with torch.random.fork_rng(devices=[]):
        models.model_eval(state["args"], state["clients"], state["server"], False, row, "all/")
    row = {k: float(v) for k, v in row.items()}
    row["round"] = rnd
    row["n_test"] = sum(len(c.test_dataset) for c in state["clients"])
    state["all_clients"].append(row)
    print(f"round {rnd}: all clients' test splits: accuracy {row['all/accu']:.4f}  "
          f"({time.time() - state['t0']:.1f} s)", flush=True)


def hook(index: int, entry: dict) -> None:
    """Called by the stand-in after each of their wandb.log calls: index 0 is their evaluation before training,
    index r the one after round r."""
    state["times"].append(round(time.time() - state["t0"], 3))
    if index > 0 and (index % every == 0 or index == rounds):
        all_clients_eval(index)


def wrap(fn):
    def wrapped(a, clients, server, num_sample_client, *rest, **kw):
        state.update(args=a, clients=clients, server=server, num_sample_client=num_sample_client)
        c0 = clients[0].train_dataset
        got = {"x_sum": float(c0.xs.double().sum()), "y_sum": int(c0.ys.sum()), "n": int(len(c0.ys)),
               "num_clients": len(clients)}
        ok = (got["n"] == check["n"] and got["y_sum"] == check["y_sum"] and got["num_clients"] == check["num_clients"]
              and abs(got["x_sum"] - check["x_sum"]) <= 1e-4 * max(1.0, abs(check["x_sum"])))
        state["data_check"] = {"theirs": got, "raysplit": check, "equal": ok}
        if not ok:
            raise SystemExit(f"their client 0's data differs from raysplit's: {got} vs {check}")
        state["t0"] = time.time()
        wandb.HOOK = hook
        return fn(a, clients, server, num_sample_client, *rest, **kw)
    return wrapped


setattr(sl, algo, wrap(getattr(sl, algo)))  # main.py's `from sl import *` then picks up the wrapper
sys.argv = ["main.py", *args]
t_start = time.time()
try:
    runpy.run_path("main.py", run_name="__main__")
finally:
    with open(out_json, "w") as f:
        json.dump({"their_logs": wandb.LOGS, "log_times_s": state["times"], "all_clients": state["all_clients"],
                   "data_check": state["data_check"], "wall_s": round(time.time() - t_start, 2),
                   "train_wall_s": round(time.time() - state["t0"], 2),
                   "num_sample_client": state.get("num_sample_client"),
                   "client_train_sizes": [len(c.train_dataset) for c in state.get("clients", [])],
                   "client_test_sizes": [len(c.test_dataset) for c in state.get("clients", [])]}, f)
