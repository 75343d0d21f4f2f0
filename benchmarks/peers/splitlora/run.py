"""FDU-INC/Split_LoRA's gpt2_ft_sfl.py (a549b60 with edits.diff) beside raysplit's ``splitlora`` on the same text,
token ids, client split and initial weights, one seed per pair of runs (README.md, "Side by side").

    .venv/bin/python benchmarks/peers/splitlora/run.py --theirs DIR --loralib SITE [--seeds 0 1 2] [--rounds 10]
    .venv/bin/python benchmarks/peers/splitlora/run.py --report [--seeds 0 1 2] [--rounds 10]

DIR: their ``SplitLoRA/examples`` with edits.diff applied; SITE: a site-packages folder holding ``loralib`` (pure
Python: ``python -m venv /tmp/peervenv && /tmp/peervenv/bin/pip install loralib``), put on PYTHONPATH for this
venv's python, which runs their script (``torch.distributed.run``, one process, gloo on CPU).

Per seed: raysplit's own data pipeline for configs/llm/splitlora.yaml with :data:`OVERRIDES` (fortunes computers,
science and people, one client each; BPE of 512 trained on the training documents; blocks of 64 tokens) writes
each client's training blocks and the held-out blocks in their jsonl (``{"context": block[:1], "completion":
block[1:]}``: their ``clm`` mask then scores the block's 63 next tokens, as raysplit's loss does); raysplit's
initial model for the seed (``torch.manual_seed(seed)`` then ``build_causal_lm``, as a run's driver builds it: 4
blocks, width 64, 4 heads, tied head), pretrained (:func:`pretrain`), is saved as the ``model.lm.pretrained``
directory raysplit's run loads and as their ``init.pt`` (a ``GPT2Model`` state dict without its ``transformer.``
prefix), and check_load.py checks their loaders take every tensor unchanged. Both then train the
same schedule: 3 clients taking turns batch by batch on one shared server model, batch 8, 33 batches per client
between averagings of the client-side LoRA (their ``--aggregate_step 99``, an edit: theirs is fixed at 100), the
mean uniform, AdamW lr 0.003 (betas 0.9/0.999, eps 1e-8, weight decay 0.01, constant), LoRA rank 4 alpha 32
without dropout, the loss on the server (plain split); each is evaluated on the held-out blocks right after every
averaging (their ``--eval_interval 99``, the whole held-out set as one batch, so their per-batch mean is the token
mean raysplit reports).

What differs and is not copied (README.md): their LoRA adapts the query and value of ``c_attn`` with a rank-4
pair each (loralib ``MergedLinear``), raysplit's peft LoRA the fused ``c_attn`` with one rank-4 pair; their
average takes four snapshots for three clients, each before that step's update; their epoch is the shortest
client's data (``zip`` of the loaders) and their global client model restarts every epoch; the LoRA draws and the
batch order are each code's own.

Each pair of runs is kept as a record, records/peers_splitlora_runs/s<seed>_r<rounds>.json (``_runs.kept``:
restored from it on a machine without the cache), so ``--report`` re-reads them without their code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "docs" / "results"))
sys.path.insert(0, str(ROOT))
from _runs import kept, median_range, restore, spec_digest  # noqa: E402

BASE = ROOT / "configs" / "llm" / "splitlora.yaml"
OUT = ROOT / "docs" / "results" / ".peers_splitlora_runs"
STEPS = 33  # batches per client between averagings
CLIENTS = 3
BATCH = 8
LR, WD = 0.003, 0.01
RANK, ALPHA = 4, 32
PRETRAIN_ON = ["cookie", "fortunes", "literature", "wisdom", "humorists", "politics"]  # none a client's
PRETRAIN_STEPS = 200
OVERRIDES = {"algorithm.server_side": "shared", "algorithm.aggregation_interval": 1,
             "train.aggregation.weights": "uniform", "model.cut": "block3", "model.lm.layers": 4,
             "model.lm.dropout": 0.0, "model.lm.adapter.rank": RANK, "model.lm.adapter.alpha": ALPHA,
             "model.lm.adapter.dropout": 0.0, "model.lm.adapter.target_modules": ["c_attn"],
             "train.batch_size": BATCH, "train.local_steps": STEPS, "train.optimizer.name": "adamw",
             "train.optimizer.lr": LR, "train.optimizer.weight_decay": WD, "data.text.generation.prompts": 0,
             "runtime.backend": "local", "runtime.torch_threads": 1, "tracking.checkpoint_every": 0,
             "tracking.progress": False, "tracking.log_checkpoint_artifact": False,
             "tracking.experiment": "peers-splitlora"}
EVAL = re.compile(r"\| Eval +\d+ at step +(\d+) \|.*\| valid loss +([\d.]+) \|")


def overrides(seed: int, rounds: int) -> dict:
    return {**OVERRIDES, "seed": seed, "train.rounds": rounds}


def inputs(cfg, seed: int, where: Path) -> dict:
    """Their jsonl files and init.pt from raysplit's data and initial model for ``seed``; what was written."""
    import torch

    from raysplit.data.text import load_text_partitioned
    from raysplit.models.causal_lm import build_causal_lm

    text = load_text_partitioned(cfg.data.text, cfg.data.partition, cfg.data.num_clients, cfg.data.test_fraction,
                                 cfg.seed, pretrained=cfg.model.lm.pretrained)  # experiment.py's own call
    where.mkdir(parents=True, exist_ok=True)

    def jsonl(name, blocks):
        with open(where / name, "w") as f:
            for b in blocks.tolist():
                f.write(json.dumps({"context": b[:1], "completion": b[1:]}) + "\n")

    for c in range(CLIENTS):
        jsonl(f"train{c}.jsonl", text.x_train[text.train_idx[c]])
    jsonl("valid.jsonl", text.x_test)
    torch.manual_seed(cfg.seed)  # the driver's build (experiment.py) of the random model, then pretrained
    full = cfg.model.lm.model_copy(update={"adapter": cfg.model.lm.adapter.model_copy(update={"kind": "full"})})
    hf = build_causal_lm(full, vocab_size=text.spec.num_classes, fixed_length=True).hf_model
    pre = pretrain(hf, text.tokenizer, cfg.data.text.context_length, seed)
    with torch.no_grad():  # the base's held-out loss, before fine-tuning (the 63 next tokens of every block)
        ids = torch.from_numpy(text.x_test)
        pre["heldout_loss"] = round(float(hf(input_ids=ids, labels=ids).loss), 4)
    hf.save_pretrained(where / "base", safe_serialization=True)  # model.lm.pretrained of raysplit's run
    # the same weights as their GPT2Model state dict: no transformer. prefix, no head (theirs is tied to their
    # server's wte copy)
    torch.save({k.removeprefix("transformer."): v.clone() for k, v in hf.state_dict().items()
                if not k.startswith("lm_head.")}, where / "init.pt")
    return {"clients": [int(len(i)) for i in text.train_idx], "heldout_blocks": int(len(text.x_test)),
            "vocab": int(text.spec.num_classes), "pretraining": pre,
            "first_block": text.x_train[text.train_idx[0][0]][:8].tolist()}


def pretrain(hf, tokenizer, context: int, seed: int) -> dict:
    """Full training of the random model on the fortune categories the clients do not hold (PRETRAIN_STEPS steps of
    16 blocks, AdamW 1e-3): a base with something for LoRA to adapt, as SplitLoRA fine-tunes a pretrained GPT-2
    (in a first try on the random base, not kept, LoRA on the attention alone barely moved either code's loss)."""
    import torch

    from raysplit.data.text import causal_blocks, load_fortunes

    corpus = load_fortunes(categories=PRETRAIN_ON)
    blocks = torch.from_numpy(causal_blocks(tokenizer.encode_batch(corpus.documents), context, tokenizer.eos_id))
    g = torch.Generator().manual_seed(1000 + seed)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    hf.train()
    for _ in range(PRETRAIN_STEPS):
        ids = blocks[torch.randint(len(blocks), (16,), generator=g)]
        loss = hf(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    hf.eval()
    return {"categories": PRETRAIN_ON, "blocks": int(len(blocks)), "steps": PRETRAIN_STEPS,
            "last_loss": round(loss.item(), 4)}


def theirs(src: Path, loralib: str, where: Path, seed: int, rounds: int, heldout: int, vocab: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{loralib}:{src / 'src'}", "OMP_NUM_THREADS": "1"}
    check = subprocess.run([sys.executable, str(HERE / "check_load.py"), str(where / "init.pt")], cwd=src / "src",
                           env=env, capture_output=True, text=True, timeout=300)
    if "mismatched [] unused []" not in check.stdout:
        raise RuntimeError(f"their loaders do not take init.pt whole: {check.stdout}{check.stderr}")
    steps = rounds * STEPS * CLIENTS
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port", str(29600 + seed),
           "src/gpt2_ft_sfl.py",
           *[a for c in range(CLIENTS) for a in (f"--train_data{c}", str(where / f"train{c}.jsonl"))],
           "--valid_data", str(where / "valid.jsonl"), "--train_batch_size", str(BATCH),
           "--valid_batch_size", str(heldout), "--seq_len", "64", "--model_card", "gpt2.tiny", "--vocab_size",
           str(vocab), "--init_checkpoint", str(where / "init.pt"), "--platform", "local", "--lr", str(LR),
           "--weight_decay", str(WD), "--correct_bias", "--adam_beta1", "0.9", "--adam_beta2", "0.999",
           "--adam_epislon", "1e-8", "--scheduler", "constant", "--warmup_step", "0", "--max_step", str(steps),
           "--max_epoch", "1000", "--save_interval", "100000000", "--eval_interval", str(STEPS * CLIENTS),
           "--log_interval", str(STEPS * CLIENTS), "--aggregate_step", str(STEPS * CLIENTS), "--lora_dim", str(RANK),
           "--lora_alpha", str(ALPHA), "--lora_dropout", "0.0", "--work_dir", str(where / "work"),
           "--random_seed", str(seed)]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=3600)
    (where / "theirs.log").write_text(proc.stdout + proc.stderr)
    evals = [(int(s), float(l)) for s, l in EVAL.findall(proc.stdout)]
    if len(evals) < rounds:
        raise RuntimeError(f"their run ended with {len(evals)} of {rounds} evaluations (exit {proc.returncode}); "
                           f"see {where / 'theirs.log'}")
    return {"steps": [s for s, _ in evals[:rounds]], "loss": [l for _, l in evals[:rounds]],
            "seconds": round(time.time() - t0, 1), "check_load": check.stdout.strip()}


def ours(seed: int, rounds: int, where: Path) -> dict:
    import raysplit

    t0 = time.time()
    res = raysplit.run(str(BASE), {**overrides(seed, rounds), "model.lm.pretrained": str(where / "base"),
                                   "tracking.uri": f"sqlite:///{where / 'mlflow.db'}",
                                   "tracking.output_dir": str(where / "outputs")})
    loss = res.rounds["eval/loss"].tolist()
    return {"rounds": res.rounds.index.tolist(), "loss": [float(x) for x in loss],
            "seconds": round(time.time() - t0, 1), "run_id": res.run_id}


def pair(src, loralib, seed, rounds) -> dict:
    from raysplit.config import load_config

    cfg = load_config(str(BASE), overrides(seed, rounds))
    where = Path("/tmp/peers_splitlora") / f"s{seed}_r{rounds}"
    made = inputs(cfg, seed, where)
    them = theirs(Path(src), loralib, where, seed, rounds, made["heldout_blocks"], made["vocab"])
    us = ours(seed, rounds, where)
    return {"eval/perplexity": float(np.exp(us["loss"][-1])), "inputs": made, "raysplit": us, "theirs": them,
            "their_commit": "a549b60 + benchmarks/peers/splitlora/edits.diff"}


def spec(seed, rounds) -> dict:
    return {"peer": "FDU-INC/Split_LoRA a549b60", "config": str(BASE.relative_to(ROOT)),
            "overrides": overrides(seed, rounds)}


def report(results: dict) -> str:
    """Per averaging (99 steps): held-out perplexity of each code, median [min, max] over the seeds, and raysplit's
    loss minus theirs, paired by seed."""
    seeds = sorted(results)
    rounds = min(len(r["raysplit"]["loss"]) for r in results.values())
    lines = ["| step | raysplit perplexity | Split_LoRA perplexity | raysplit - Split_LoRA, loss (nats) per seed |",
             "|---|---|---|---|"]
    base = [results[s]["inputs"]["pretraining"]["heldout_loss"] for s in seeds]
    lines.append(f"| 0 (the base) | {median_range(np.exp(base), '.1f')} | {median_range(np.exp(base), '.1f')} | "
                 "0 (the same weights) |")
    for k in range(rounds):
        ours_ = [np.exp(results[s]["raysplit"]["loss"][k]) for s in seeds]
        them = [np.exp(results[s]["theirs"]["loss"][k]) for s in seeds]
        diff = ", ".join(f"{results[s]['raysplit']['loss'][k] - results[s]['theirs']['loss'][k]:+.3f}" for s in seeds)
        lines.append(f"| {results[seeds[0]]['theirs']['steps'][k]} | {median_range(ours_, '.1f')} | "
                     f"{median_range(them, '.1f')} | {diff} |")
    def gain(code):
        return ", ".join(f"{b - results[s][code]['loss'][rounds - 1]:.3f}" for s, b in zip(seeds, base))

    worst = ", ".join(f"{max(abs(a - b) for a, b in zip(r['raysplit']['loss'], r['theirs']['loss'])):.3f}"
                      for r in (results[s] for s in seeds))
    lines += ["", f"Seeds {', '.join(map(str, seeds))}. Fine-tuning gain in held-out loss (the base's minus the last "
              f"evaluation's, nats): raysplit {gain('raysplit')}; Split_LoRA {gain('theirs')}. Largest |raysplit - "
              f"Split_LoRA| over the {rounds} evaluations: {worst} nats.", "", verdict(results, seeds, rounds)]
    return "\n".join(lines)


def verdict(results: dict, seeds: list, rounds: int) -> str:
    """peers.md's rule: "within the seeds' spread" when the median paired difference between the codes (final
    held-out perplexity) is smaller than either code's spread (largest minus smallest) over its seeds."""
    ours_ = [float(np.exp(results[s]["raysplit"]["loss"][rounds - 1])) for s in seeds]
    them = [float(np.exp(results[s]["theirs"]["loss"][rounds - 1])) for s in seeds]
    diff = float(np.median([a - b for a, b in zip(ours_, them)]))
    spread = (max(ours_) - min(ours_), max(them) - min(them))
    within = len(seeds) > 1 and abs(diff) < min(spread)
    return (f"Verdict: **{'within' if within else 'not within'} the seeds' spread** at step "
            f"{results[seeds[0]]['theirs']['steps'][rounds - 1]}: raysplit minus Split_LoRA {diff:+.2f} perplexity "
            f"(median, paired by seed; spreads {spread[0]:.2f} and {spread[1]:.2f}; seeds {len(seeds)}).")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--theirs", help="their SplitLoRA/examples, edits.diff applied")
    ap.add_argument("--loralib", help="a site-packages folder with loralib")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--report", action="store_true", help="run nothing: the table from the kept runs")
    args = ap.parse_args()
    results = {}
    for s in args.seeds:
        out = OUT / f"s{s}_r{args.rounds}.json"
        if args.report:
            if restore(out, digest=spec_digest(spec(s, args.rounds))):
                results[s] = json.loads(out.read_text())
        else:
            if not (args.theirs and args.loralib):
                ap.error("--theirs and --loralib are needed to run (or --report)")
            results[s] = kept(out, "peers-splitlora", f"Split_LoRA beside raysplit seed {s}", spec(s, args.rounds),
                              lambda s=s: pair(args.theirs, args.loralib, s, args.rounds))
    if not results:
        print("no runs kept for these seeds")
        return 1
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
