"""Tokens per second training a GPT-2 with LoRA through raysplit against a plain ``peft`` loop (issue 71, Targets).

The setting, where compute dominates: a GPT-2 of 6 blocks, width 256, 4 heads, context 128 (random initial weights),
LoRA rank 8 (alpha 16) on ``c_attn`` and ``c_fc`` through ``peft``, on the fortunes corpus (four categories, a
byte-level BPE of 1024 tokens trained on them), batch 8, Adam (lr 1e-3), one torch thread everywhere (what an actor
gets). Arms:

- **plain**: one process, no raysplit: ``transformers``' ``GPT2LMHeadModel`` wrapped by ``peft.get_peft_model``,
  ``model(input_ids=x, labels=x).loss``, ``loss.backward()``, one ``torch.optim.Adam`` over the adapters. Its initial
  weights (base and adapters) are loaded from the raysplit run's initial parts, and its batches are the client's
  (the permutation of its blocks drawn from (seed, client, epoch), as ``runtime/client/data.py`` draws them), so it
  trains the same model on the same batches with the same optimizer. After the timed rounds the local backend's
  server adapters (blocks 2-5) are compared with the plain model's: "the same arithmetic" is checked, not assumed.
- **local**: raysplit's SFLV1 with one client on ``runtime.backend: local``, U-shaped (the default for a language
  model: the client keeps the embeddings, block1, block6 and the head with the loss; the server blocks 2-5).
- **ray**: the same over Ray (the transport the runtime picks, ``auto``; one server actor and one client actor).

Each repetition times one round of every arm back to back (interleaved: one load for all; the plain loop and the
local backend in turns first; a compiled graph's idle actors are stopped while the others are timed), ``--repeats``
times after ``--warmup`` rounds; a round is ``--steps`` steps of the one client (SFLV1's per-client server copy,
the averaging of one, the round's clocks included). Reported: each arm's tokens per second (median of the repetitions) and each raysplit arm's time over the
plain loop's, the median of the paired ratios; targets: local within 1.1x, Ray within 1.3x. Beside each wall time,
the CPU seconds the arm's processes used (this process; over Ray also the server and client actors and the compiled
graphs' proxy actors, whose pollers count): on a machine others share, a wall time also holds their time slices, a
CPU time mostly not, so the CPU ratio shows what raysplit adds where the wall ratio is blurred by the load.

    .venv/bin/python benchmarks/lm_tokens.py [--steps 6] [--repeats 7] [--warmup 1]
    .venv/bin/python benchmarks/lm_tokens.py --profile local   # cProfile of 3 local rounds instead

Writes benchmarks/out/lm_tokens.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load, mmm, resolved_at_start, save  # noqa: E402
from overhead import RaysplitRounds  # noqa: E402

from raysplit.config import load_config  # noqa: E402

TARGET = {"local": 1.1, "ray": 1.3}
SIZE = {"layers": 6, "width": 256, "heads": 4, "context": 128, "batch": 8, "vocab": 1024, "rank": 8}


def make_cfg(backend: str, steps: int, size: dict = SIZE):
    over = {
        "name": "lm-tokens", "seed": 0,
        "algorithm": {"name": "sflv1"},
        "data.num_clients": 1, "data.partition.name": "iid", "data.test_fraction": 0.0,
        "data.text.corpus": "fortunes", "data.text.categories": ["computers", "science", "people", "wisdom"],
        "data.text.context_length": size["context"], "data.text.test_fraction": 0.1,
        "data.text.tokenizer": {"kind": "bpe", "vocab_size": size["vocab"]},
        "model.cut": "block1",
        "model.lm": {"family": "gpt2", "layers": size["layers"], "width": size["width"], "heads": size["heads"],
                     "max_positions": size["context"],
                     "adapter": {"kind": "lora", "rank": size["rank"], "alpha": 2.0 * size["rank"],
                                 "target_modules": ["c_attn", "c_fc"]}},
        "train.rounds": 1000, "train.batch_size": size["batch"], "train.local_steps": steps,
        "train.optimizer": {"name": "adam", "lr": 1e-3},
        "train.participation.count": 1, "clock.profile": "uniform",
        "runtime.backend": backend, "runtime.num_workers": 1, "runtime.torch_threads": 1,
        "runtime.server.num_cpus": 1, "runtime.client.num_cpus": 0,
        "tracking.enabled": False, "tracking.progress": False,
    }
    return load_config(None, over)


class PlainPeft:
    """The plain single-process loop (module docstring): ``transformers`` + ``peft``, no raysplit code in the step."""

    def __init__(self, p, cfg):
        from peft import LoraConfig, get_peft_model
        from transformers import GPT2Config, GPT2LMHeadModel

        from raysplit.runtime import transport

        plan = p.inputs.plan
        facts = plan.model
        ad = cfg.model.lm.adapter
        # raysplit's initial weights, read through its own split of the same model (the parts share the modules)
        ref = facts.build()
        head, middle, tail = ref.split3(facts.cut, facts.tail_cut)
        torch.nn.ModuleDict({"head": head, "tail": tail}).load_state_dict(transport.unpack_state(p.inputs.client_init))
        middle.load_state_dict(transport.unpack_state(p.inputs.server_init))
        hf = ref.hf_model.config
        base = GPT2LMHeadModel(GPT2Config(vocab_size=hf.vocab_size, n_positions=hf.n_positions, n_embd=hf.n_embd,
                                          n_layer=hf.n_layer, n_head=hf.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
        self.model = get_peft_model(base, LoraConfig(r=ad.rank, lora_alpha=ad.alpha, lora_dropout=ad.dropout,
                                                     target_modules=list(ad.target_modules), fan_in_fan_out=True,
                                                     bias="none"))
        self.model.base_model.model.load_state_dict(ref.hf_model.state_dict(), strict=True)
        self.model.train()
        self.opt = torch.optim.Adam([q for q in self.model.parameters() if q.requires_grad],
                                    lr=cfg.train.optimizer.lr)
        self.x = p.inputs.train_data["x"]
        self.idx = np.asarray(p.inputs.train_idx[0])
        self.seed, self.bs = cfg.seed, cfg.train.batch_size
        self.cursor, self.perm = (0, 0), None
        self.middle_names = {n for n, q in middle.named_parameters() if q.requires_grad}
        self.ref_middle = middle  # the same modules as ref.hf_model's blocks 2..N-1: read back for the check
        self.middle_init = {n: q.detach().clone() for n, q in middle.named_parameters() if n in self.middle_names}
        self.ref = ref

    def batch(self) -> torch.Tensor:
        epoch, pos = self.cursor
        if pos >= len(self.idx):
            epoch, pos = epoch + 1, 0
        if self.perm is None or self.perm[0] != epoch:
            self.perm = (epoch, np.random.default_rng([self.seed, 0, epoch]).permutation(self.idx))
        b = self.perm[1][pos:pos + self.bs]
        self.cursor = (epoch, pos + len(b))
        return torch.as_tensor(self.x[b], dtype=torch.long)

    def round(self, steps: int) -> None:
        for _ in range(steps):
            x = self.batch()
            loss = self.model(input_ids=x, labels=x).loss
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()

    def server_part_state(self) -> dict:
        """The plain model's weights under the server part's names (blocks 2..N-1 of the split)."""
        self.ref.hf_model.load_state_dict(self.model.base_model.model.state_dict())
        return {n: q.detach().clone() for n, q in self.ref_middle.named_parameters() if n in self.middle_names}


def ray_pids(arm: RaysplitRounds) -> list[int]:
    """The processes a Ray arm computes in: its server and client actors and, with compiled graphs, the graphs'
    proxy actors (what :meth:`RaysplitRounds.paused` stops)."""
    import psutil
    import ray

    b = arm.rt.backend
    pids = ray.get([a.__ray_call__.remote(lambda s: os.getpid()) for a in [b.server, *b.workers]], timeout=60)
    return pids + [q.pid for q in psutil.process_iter(["cmdline"])
                   if "DAGDriverProxyActor" in " ".join(q.info["cmdline"] or [])]


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by this process and ``pids``."""
    import psutil

    total = time.process_time()
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def timed_cpu(fn, pids: list[int]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and ``pids``) of ``fn()``."""
    c0, t0 = cpu_seconds(pids), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds(pids) - c0


def profile(arm: str, steps: int) -> int:
    """Where an arm's time goes: cProfile over 3 rounds (after one to warm up), the top 25 by cumulative time."""
    import cProfile
    import pstats

    torch.set_num_threads(1)
    cfg = make_cfg("local", steps)
    if arm == "plain":
        from raysplit.experiment import prepare

        plain = PlainPeft(prepare(cfg), cfg)
        run = lambda: plain.round(steps)  # noqa: E731
    else:
        rounds = RaysplitRounds(cfg)
        run = rounds.round
    run()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        run()
    prof.disable()
    st = pstats.Stats(prof)
    print(f"{arm}: {st.total_calls} function calls in {3 * steps} steps, {st.total_tt:.2f} s under the profiler")
    st.sort_stats("cumulative").print_stats(25)
    st.sort_stats("tottime").print_stats(15)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="steps of the one client a round")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds of each arm, interleaved")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-ray", action="store_true", help="the local backend only")
    ap.add_argument("--tag", default="lm_tokens")
    ap.add_argument("--profile", choices=["local", "plain"], help="instead: cProfile 3 rounds of that arm")
    a = ap.parse_args()
    if a.profile:
        return profile(a.profile, a.steps)
    torch.set_num_threads(1)
    load0 = load()
    print(f"load {load0}", flush=True)
    if not a.no_ray:
        import ray

        ray.init(num_cpus=4, object_store_memory=512 * 2**20, include_dashboard=False)
    from raysplit.experiment import prepare

    local = RaysplitRounds(make_cfg("local", a.steps))
    cfg = make_cfg("local", a.steps)
    plain = PlainPeft(prepare(cfg), cfg)
    arms = {"plain": lambda: plain.round(a.steps), "local": local.round}
    resolved = {}
    ray_arm = None
    if not a.no_ray:
        with resolved_at_start() as resolved:
            ray_arm = RaysplitRounds(make_cfg("ray", a.steps))
        arms["ray"] = ray_arm.round
    tokens_per_round = a.steps * SIZE["batch"] * SIZE["context"]
    times = {k: [] for k in arms}
    cpu = {k: [] for k in arms}
    pids = {"plain": [], "local": [], "ray": []}

    def others_paused():  # a compiled graph's idle actors poll their channels: stopped while the others are timed
        return ray_arm.paused() if ray_arm is not None else contextlib.nullcontext()

    try:
        for _ in range(a.warmup):
            with others_paused():
                arms["plain"]()
                arms["local"]()
            if ray_arm is not None:
                arms["ray"]()
        if ray_arm is not None:
            pids["ray"] = ray_pids(ray_arm)
        for i in range(a.repeats):
            with others_paused():
                for k in ("plain", "local") if i % 2 == 0 else ("local", "plain"):  # neither always first
                    wall, c = timed_cpu(arms[k], pids[k])
                    times[k].append(wall)
                    cpu[k].append(c)
            if ray_arm is not None:
                wall, c = timed_cpu(arms["ray"], pids["ray"])
                times["ray"].append(wall)
                cpu["ray"].append(c)
            print(f"repeat {i}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
        got, want = local.server_state(), plain.server_part_state()
        check = max(float((got[k].double() - v.double()).abs().max()) for k, v in want.items())
        moved = max(float((plain.middle_init[k].double() - v.double()).abs().max()) for k, v in want.items())
    finally:
        local.rt.shutdown()
        if ray_arm is not None:
            ray_arm.rt.shutdown()
    results = {"tokens_per_round": tokens_per_round, "size": SIZE, "steps": a.steps,
               "max_abs_adapter_diff_plain_vs_local": check, "max_abs_adapter_change_plain": moved,
               "resolved": {k: str(v) for k, v in resolved.items()},
               "raw_s": times, "raw_cpu_s": cpu}
    for k, ts in times.items():
        results[k] = {"tokens_per_s": mmm([tokens_per_round / t for t in ts]), "s_per_round": mmm(ts),
                      "tokens_per_cpu_s": mmm([tokens_per_round / t for t in cpu[k]]), "cpu_s_per_round": mmm(cpu[k])}
        if k != "plain":
            ratios = [t / b for t, b in zip(ts, times["plain"])]
            results[k]["ratio"] = float(np.median(ratios))
            results[k]["ratios"] = mmm(ratios)
            results[k]["met"] = bool(results[k]["ratio"] <= TARGET[k])
            cpu_ratios = [t / b for t, b in zip(cpu[k], cpu["plain"])]
            results[k]["cpu_ratio"] = float(np.median(cpu_ratios))
            results[k]["cpu_ratios"] = mmm(cpu_ratios)
    load1 = load()
    print(f"load at the end {load1}")
    print("| arm | tokens/s (median, min-max) | time over the plain loop (median of paired ratios, min-max) | "
          "target | tokens per CPU second | CPU time over the plain loop's |")
    print("|---|---|---|---|---|---|")
    for k in times:
        tps, tpc = results[k]["tokens_per_s"], results[k]["tokens_per_cpu_s"]
        r = results[k]
        ratio = "1" if k == "plain" else f"{r['ratio']:.3f}x ({r['ratios']['min']:.2f}-{r['ratios']['max']:.2f})"
        cratio = "1" if k == "plain" else f"{r['cpu_ratio']:.3f}x ({r['cpu_ratios']['min']:.2f}-" \
                                          f"{r['cpu_ratios']['max']:.2f})"
        tgt = "-" if k == "plain" else f"<= {TARGET[k]}x, {'met' if r['met'] else 'missed'}"
        print(f"| {k} | {tps['median']:.0f} ({tps['min']:.0f}-{tps['max']:.0f}) | {ratio} | {tgt} | "
              f"{tpc['median']:.0f} | {cratio} |")
    print(f"largest adapter difference, plain loop vs local backend (server blocks): {check:.1e} (largest change "
          f"from the initial adapters: {moved:.1e})")
    if resolved:
        print(f"ray resolved: {results['resolved']}")
    if not a.no_ray:
        import ray

        ray.shutdown()
    save(a.tag, {"args": vars(a), "results": results, "load_before": load0, "load_at_end": load1,
                 "threads": os.environ.get("OMP_NUM_THREADS")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
