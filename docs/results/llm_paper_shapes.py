"""SplitLoRA against federated LoRA at the paper's own shapes (issue 73, item 4): FLOPs and bytes per training step
and the simulated time per round on raysplit's default homogeneous clock, quantities that do not depend on training,
counted on inputs of the right shape with random weights, no data and no training.

The shapes and where each comes from:
- GPT-2 S (12 blocks, width 768, 12 heads, vocab 50257, 1024 positions) and GPT-2 M (24 blocks, width 1024, 16 heads):
  SplitLoRA's paper (Lin et al., arXiv 2407.00952) fine-tunes both on E2E NLG; the sizes are GPT-2's own.
- context 512 and batch 8: microsoft/LoRA's NLG defaults for E2E training (seq_len 512, train_batch_size 8), which
  FDU-INC/Split_LoRA's gpt2_ft_sfl.py keeps (configs/llm/splitlora-gpt2s-e2e.yaml). They are the authors' code's
  defaults, not checked against the paper's text, which is not stored here.
- LoRA rank 4, alpha 32, on c_attn only (LoRA's E2E setup; configs/llm/splitlora-gpt2s-e2e.yaml).
- SplitLoRA's client: the embeddings and the first 3 blocks (model.cut block3, the code's `block=3`), plain split
  (the server holds the rest and the LM head and receives the targets); 3 clients (the code trains three).
- 10 local steps a round (the study's; the config's 100 would scale both methods' compute and per-step traffic by
  10 and leave the adapter traffic as it is).
And the study's tiny shapes (configs/llm/families.yaml: 2 blocks of width 64, 4 heads, context 64, batch 16, vocab
512, LoRA r16 alpha 32 on c_attn, c_fc, lm_head, cut block1, 4 clients), validated against a real run's metrics in
notes/llm-paper-shapes.md.

Counted as a run charges them: the parts are raysplit's own (build_causal_lm with fixed_length, CausalLM.split),
FLOPs by torch.utils.flop_counter (raysplit/clock.py's FlopCache) over the client part's forward and its backward
from the hidden states' gradient, the server part's forward, lm_loss and backward (into the hidden states), and for
FedAvg the whole model's; bytes as raysplit/runtime/transport.py counts an array (shape x dtype): the hidden states
(B, T, D) float32 alone cross the cut (fixed-length blocks: no mask or positions travel), the targets (B, T) int64
up, the hidden states' gradient down; adapters as the trainable tensors. The meta device cannot run transformers'
causal mask (it reads a value), so the paper shapes are counted on the CPU at batch 1 and scaled by 8 (every FLOP
that flop_counter counts, a matmul, is linear in the batch; the bytes are counted at batch 8); the tiny ones at
their own batch.

The time per round (:func:`round_seconds`): clients in parallel, each downloading its adapters, then per step its
compute, the upload, the server's compute, the download, then its adapters up; the server serves the clients'
steps one after another (one server clock), so the last of n clients waits (n - 1) server steps more a round.

    python docs/results/llm_paper_shapes.py        # prints the table in notes/llm-paper-shapes.md; about 3 minutes uncached

Each shape's counts are kept as a committed record (docs/results/records/llm_costs/, kind script).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import kept  # noqa: E402

from raysplit.clock import FlopCache, nbytes  # noqa: E402
from raysplit.lm_metrics import lm_loss  # noqa: E402
from raysplit.models.adapters import AdapterConfig, trainable_state  # noqa: E402
from raysplit.models.causal_lm import LMConfig, build_causal_lm  # noqa: E402

COSTS = Path(__file__).resolve().parent / ".llm_costs"  # the counts' caches (ignored); records/llm_costs/
CLIENT_FLOPS, UP, DOWN, SERVER_FLOPS = 1e10, 1e7, 1e7, 1e12  # raysplit/clock.py's homogeneous defaults
STEPS = 10
# (label, layers, width, heads, vocab, positions, context, batch, rank, targets, cut, clients)
SHAPES = [
    ("study's tiny GPT-2", 2, 64, 4, 512, 64, 64, 16, 16, ["c_attn", "c_fc", "lm_head"], "block1", 4),
    ("GPT-2 S", 12, 768, 12, 50257, 1024, 512, 8, 4, ["c_attn"], "block3", 3),
    ("GPT-2 M", 24, 1024, 16, 50257, 1024, 512, 8, 4, ["c_attn"], "block3", 3),
]


def _flops(fn) -> int:
    """``fn()``'s FLOPs as the clock counts a part's step (raysplit/clock.py's FlopCache)."""
    return FlopCache().count((), fn)


def _nbytes(tensors) -> int:
    return sum(nbytes(t) for t in tensors)


def count(layers, width, heads, vocab, positions, context, batch, rank, targets, cut, counted_batch) -> dict:
    """Per client step: FLOPs of each part and bytes each way; adapters' bytes of each part."""
    lm = LMConfig(family="gpt2", layers=layers, width=width, heads=heads, max_positions=positions, vocab_size=vocab,
                  adapter=AdapterConfig(kind="lora", rank=rank, alpha=32, target_modules=targets))
    torch.manual_seed(0)
    model = build_causal_lm(lm, fixed_length=True)
    client, server = model.split(cut)
    ids = torch.randint(0, vocab, (counted_batch, context))
    scale = batch // counted_batch

    def client_step():
        h = client(ids)
        h.backward(torch.ones_like(h))
    h = client(ids).detach()

    def server_step():
        x = h.clone().requires_grad_(True)
        lm_loss(server(x), ids).backward()

    def whole_step():
        lm_loss(model(ids), ids).backward()
    act = nbytes(h) * scale  # the hidden states up; their gradient, of their shape, down
    return {"client_flops": scale * _flops(client_step), "server_flops": scale * _flops(server_step),
            "whole_flops": scale * _flops(whole_step), "hidden_bytes": act, "counted_batch": counted_batch,
            "target_bytes": nbytes(ids) * scale,
            "client_adapter_bytes": _nbytes(trainable_state(client).values()),
            "model_adapter_bytes": _nbytes(trainable_state(model).values())}


def round_seconds(c: dict, clients: int, steps: int = STEPS, *, client_flops=CLIENT_FLOPS, up=UP, down=DOWN,
                  server_flops=SERVER_FLOPS) -> dict:
    """Simulated seconds of one synchronous round for each method, bounded: SplitLoRA's clients in parallel with
    only the server's steps queued (``splitlora``, a lower bound) and every client's steps one after another
    (``splitlora_serial``, an upper bound on any order the clock may charge them in: the study's run, 2.849 s a round
    at the tiny shapes, lies between the two); FedAvg's clients in parallel (its run agrees)."""
    step = (c["client_flops"] / client_flops + (c["hidden_bytes"] + c["target_bytes"]) / up
            + c["server_flops"] / server_flops + c["hidden_bytes"] / down)
    adapters = c["client_adapter_bytes"] / down + c["client_adapter_bytes"] / up
    splitlora = adapters + steps * step + (clients - 1) * c["server_flops"] / server_flops
    serial = adapters + clients * steps * step
    fedavg = c["model_adapter_bytes"] / down + steps * c["whole_flops"] / client_flops + c["model_adapter_bytes"] / up
    return {"splitlora": splitlora, "splitlora_serial": serial, "fedavg": fedavg, "ratio": splitlora / fedavg,
            "ratio_serial": serial / fedavg}


def main() -> None:
    print(f"Per client step and per round of {STEPS} local steps; clock: clients {CLIENT_FLOPS:g} FLOP/s, "
          f"{UP / 1e6:g} MB/s up and {DOWN / 1e6:g} MB/s down, server {SERVER_FLOPS:g} FLOP/s\n")
    print("| model (blocks, width, vocab; context x batch; LoRA r, targets; cut; clients) | SplitLoRA client GFLOP "
          "a step | SplitLoRA server GFLOP a step | FedAvg client GFLOP a step | SplitLoRA MB up / down a step | "
          "adapter MB a round each way: SplitLoRA, FedAvg | s a round: SplitLoRA (parallel to serial), FedAvg | "
          "SplitLoRA / FedAvg (parallel to serial) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, layers, width, heads, vocab, pos, ctx, batch, rank, targets, cut, n in SHAPES:
        spec = {"layers": layers, "width": width, "heads": heads, "vocab": vocab, "positions": pos, "context": ctx,
                "batch": batch, "rank": rank, "alpha": 32, "targets": targets, "cut": cut, "split": "plain"}
        c = kept(COSTS / f"{label.replace(' ', '_').replace(chr(39), '')}.json", "llm-paper-shapes", label, spec,
                 lambda: count(layers, width, heads, vocab, pos, ctx, batch, rank, targets, cut, counted_batch=1 if layers > 2 else batch))
        t = round_seconds(c, n)
        print(f"| {label} ({layers}, {width}, {vocab}; {ctx} x {batch}; r{rank} {'+'.join(targets)}; {cut}; {n}) | "
              f"{c['client_flops'] / 1e9:.3f} | {c['server_flops'] / 1e9:.3f} | {c['whole_flops'] / 1e9:.3f} | "
              f"{(c['hidden_bytes'] + c['target_bytes']) / 1e6:.3f} / {c['hidden_bytes'] / 1e6:.3f} | "
              f"{c['client_adapter_bytes'] / 1e6:.4f}, {c['model_adapter_bytes'] / 1e6:.4f} | "
              f"{t['splitlora']:.2f} to {t['splitlora_serial']:.2f}, {t['fedavg']:.2f} | "
              f"{t['ratio']:.2f} to {t['ratio_serial']:.2f} |")


if __name__ == "__main__":
    main()
