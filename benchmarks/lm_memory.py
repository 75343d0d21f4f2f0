"""Memory per extra hosted client of a LoRA language model (issue 71, item 3): the growth against the adapters
and their optimizer state.

One client host (the local backend, one worker) hosts N clients of a split GPT-2 (U-shaped, cut at block1, LoRA on
c_attn); PSL runs one round (every client keeps its own adapters and Adam state; every client's slot is alive at
once in the round, then pooled). Each (N, mode) runs in a fresh process; after the round it reports

- tensor bytes the host holds for its clients: every distinct storage (``data_ptr``) among the pooled client
  modules, the clients' own states and their optimizer states, the frozen base once; and its growth per client;
- the process's resident memory (VmRSS after ``gc.collect`` and ``malloc_trim``), whose slope over N is the
  growth per extra client as the operating system sees it (noisy to about a megabyte);

for ``shared`` (this tree: one frozen base per process, adapter-only states) and ``copies`` (the behaviour before:
every state holds every weight and each client module is a fresh model; emulated in-process as
tests/test_lm_adapters.py does). The reference is the adapters' bytes ``a`` and, with Adam's two moments, ``3a``
per client (the module's adapters, the two moments; the client's own saved adapters add one ``a`` more).

Run: ``make bench-lm-memory`` (``python benchmarks/lm_memory.py``). A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, load, save  # noqa: E402

sys.path.insert(0, str(ROOT))

MODEL = {"family": "gpt2", "layers": 4, "width": 512, "heads": 8, "max_positions": 64,
         "adapter": {"kind": "lora", "rank": 8, "alpha": 16, "target_modules": ["c_attn"]}}


def rss_bytes() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def config(clients: int, out: Path):
    from raysplit.config import load_config

    over = {"name": "lm-memory", "seed": 0, "algorithm": {"name": "psl"},
            "data": {"num_clients": clients, "partition": {"name": "iid"}, "test_fraction": 0.2,
                     "text": {"corpus": "fortunes", "categories": ["computers", "science", "people", "wisdom"],
                              "context_length": 64, "tokenizer": {"kind": "bpe", "vocab_size": 2048}}},
            "model": {"cut": "block1", "lm": MODEL},
            "train": {"rounds": 1, "batch_size": 4, "local_steps": 1, "optimizer": {"name": "adam", "lr": 1e-3},
                      "participation": {"fraction": 1.0}},
            "eval": {"batch_size": 64}, "runtime": {"backend": "local", "num_workers": 1, "torch_threads": 1},
            "tracking": {"enabled": False, "progress": False, "output_dir": str(out)}}
    return load_config(None, over)


def emulate_copies() -> None:
    """The behaviour before adapter-only states: no block marked adapter-only, a fresh model per built part."""
    from raysplit.models import adapters
    from raysplit.runtime.plan import ModelFacts

    adapters.mark_adapter_only = lambda model: None
    ModelFacts.shares_base = property(lambda self: False)


def tensors_of(obj, out: list) -> None:
    import torch

    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            tensors_of(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensors_of(v, out)


def distinct_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def one(clients: int, mode: str) -> dict:
    """One (N, mode) measurement in this process."""
    import torch

    torch.set_num_threads(1)
    if mode == "copies":
        emulate_copies()
    from raysplit.experiment import prepare
    from raysplit.runtime import runtime_for

    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(clients, Path(tmp))
        p = prepare(cfg)
        rt = runtime_for(cfg.runtime, p.inputs)
        try:
            rss_setup = rss_bytes()
            t0 = time.perf_counter()
            driver = p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed)
            driver.run(0, 1, lambda r, st: None)
            wall = time.perf_counter() - t0
            host = rt.backend.workers[0]
            assert len(host.data.train_idx) == clients
            st = host.states
            modules = [m for pool in st._pools.values() for m in pool] + [s.module for s in st.slots.values()]
            held: list = []
            for m in modules:
                held += list(m.parameters()) + list(m.buffers())
            own: list = []
            tensors_of([st.own.get(c) for c in host.data.train_idx], own)
            opt: list = []
            tensors_of([st.opt_state.get(c) for c in host.data.train_idx], opt)
            trainable = [q for q in modules[0].parameters() if q.requires_grad]
            frozen = [q for q in modules[0].parameters() if not q.requires_grad]
            return {"clients": clients, "mode": mode, "modules": len(modules),
                    "module_bytes": distinct_bytes(held), "own_bytes": distinct_bytes(own),
                    "opt_bytes": distinct_bytes(opt), "host_bytes": distinct_bytes(held + own + opt),
                    "adapter_bytes": sum(q.numel() * q.element_size() for q in trainable),
                    "frozen_bytes": distinct_bytes(frozen),
                    "client_state_bytes": sum(v.numel() * v.element_size() for v in modules[0].state_dict().values()),
                    "rss_setup": rss_setup, "rss_after": rss_bytes(), "round_s": wall}
        finally:
            rt.shutdown()


def slope(xs, ys) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--modes", nargs="+", default=["shared", "copies"], choices=["shared", "copies"])
    ap.add_argument("--one", nargs=2, metavar=("N", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1])))
        return
    load_start = load()
    rows = []
    for mode in args.modes:
        for n in args.clients:
            res = subprocess.run([sys.executable, __file__, "--one", str(n), mode], capture_output=True, text=True,
                                 cwd=ROOT)
            if res.returncode:
                sys.exit(f"lm_memory: {n} clients, {mode}: failed\n{res.stderr[-3000:]}")
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{mode:7s} N={n:2d}: host tensors {r['host_bytes'] / 2**20:8.2f} MiB, "
                  f"RSS {r['rss_after'] / 2**20:8.1f} MiB, round {r['round_s']:.1f} s", flush=True)
    summary = {}
    for mode in args.modes:
        rs = [r for r in rows if r["mode"] == mode]
        ns = [r["clients"] for r in rs]
        a = rs[0]["adapter_bytes"]
        summary[mode] = {"adapter_bytes": a, "frozen_bytes": rs[0]["frozen_bytes"],
                         "client_state_bytes": rs[0]["client_state_bytes"],
                         "tensor_bytes_per_client": slope(ns, [r["host_bytes"] for r in rs]),
                         "rss_per_client": slope(ns, [r["rss_after"] for r in rs]),
                         "per_client_over_adapters": slope(ns, [r["host_bytes"] for r in rs]) / a}
    print(f"\nmodel: {MODEL}; load at start {load_start}, at end {load()}")
    print("| mode | adapters a, KiB | client part's frozen base, MiB | tensors per extra client, KiB (x a) "
          "| RSS per extra client, KiB |")
    print("|---|---|---|---|---|")
    for mode, s in summary.items():
        print(f"| {mode} | {s['adapter_bytes'] / 1024:.1f} | {s['frozen_bytes'] / 2**20:.2f} | "
              f"{s['tensor_bytes_per_client'] / 1024:.1f} ({s['per_client_over_adapters']:.2f} a) | "
              f"{s['rss_per_client'] / 1024:.0f} |")
    path = save("lm_memory", {"model": MODEL, "rows": rows, "summary": summary, "load_at_start": load_start,
                              "load_at_end": load()})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
