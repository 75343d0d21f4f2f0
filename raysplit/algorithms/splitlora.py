"""SplitLoRA (Lin et al., "SplitLoRA: a split parameter-efficient fine-tuning framework for large language
models", arXiv 2407.00952; code FDU-INC/Split_LoRA, ``examples/src/gpt2_ft_sfl.py``): split federated learning
with LoRA adapters on a decoder language model (GPT-2 S/M on E2E in the paper).

As the paper describes it, SplitLoRA is SplitFed (SFL V1): every client fine-tunes the LoRA adapters of its
client-side model (embeddings and the first blocks, the frozen base untouched) and sends its hidden states to the
server, which fine-tunes the server-side adapters (the remaining blocks and the LM head) with a server-side model
per client, averaged; a fed server averages the clients' client-side adapters every aggregation interval. Here
that is raysplit's SFLV1 (per-client server copies merged every round, FedAvg of the client parts) with:

- ``aggregation_interval`` I (the paper's aggregation interval): client-side adapters are averaged every I rounds
  of ``train.local_steps`` iterations each (I = 1: every round, SFLV1 exactly); in between, every client keeps its
  own adapters (and its optimizer state, always kept per client), and the global model evaluated is the last
  aggregate with the current server part, as the code evaluates it; the run's last round aggregates too. The
  aggregate averages the clients that trained since the last aggregation, weighted by
  ``train.aggregation.weights`` (default: by samples).
- ``server_side``: ``copies`` (the paper's SFL V1: a server-side copy per client each round, the copies averaged,
  so adapters are aggregated on both sides) or ``shared`` (the code: one server-side model that serves the clients
  in turn, one batch of each client after another in the round's order, and is never averaged: only the
  client-side adapters aggregate).

Where the code differs from the paper, and what raysplit does:

- Aggregation: the code averages the client-side ``lora_A``/``lora_B`` uniformly (``fed_avg``: a plain mean) every
  100 training steps counted over all clients (``aggregate_step = 100`` with three clients: about 33 steps each,
  so ``train.local_steps: 33`` with I = 1); set ``train.aggregation.weights: uniform`` for its mean. Only the
  adapters train, and the frozen base is the same on every client, so averaging the client parts averages their
  adapters; the base comes out bit for bit.
- The split: the code sends the targets to the server, which holds the LM head and computes the loss
  (``model.lm.split: plain``, as configs/llm/splitlora.yaml sets it); raysplit's default for language models, the
  U-shape (head and loss on the client, the text never leaves it), runs SplitLoRA too.
- Not built: the code's label smoothing (0.1) and its linear warm-up schedule (raysplit's schedules are
  ``train.optimizer.schedule``'s); the code's client-side model holds three of GPT-2's twelve blocks
  (``model.cut: block3``).
- Read from the code at a549b60 (benchmarks/peers/splitlora/README.md, file:line there): LoRA on the query and
  value projections of ``c_attn`` only (``enable_lora=[True, False, True]``; raysplit's ``target_modules`` and
  peft's ``c_attn`` adapt the fused projection whole); the loss over the completion only (its ``clm`` mask; raysplit's
  ``data.text.loss_on``, ``completion`` by default on E2E); its learning-rate schedule drives the server's optimizer
  only (the clients' stays constant); its averaging snapshots four client states for three clients (one counted
  twice) and its global client model restarts from the initial checkpoint every epoch: neither copied.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import CopiesParams, register
from .baselines import PSL, SFLV1
from ..errors import ConfigError


class SplitLoRAParams(CopiesParams):
    aggregation_interval: int = Field(default=1, ge=1, description="I: rounds (of train.local_steps iterations) "
                                      "between averagings of the client-side adapters (the paper's aggregation "
                                      "interval; 1: every round)")
    server_side: Literal["copies", "shared"] = Field(
        default="copies", description="copies: a server-side copy per client, averaged every round (the paper's "
        "SFL V1); shared: one server-side model serving the clients' batches in turn, never averaged (the code)")


@register
class SplitLoRA(SFLV1):
    """SplitLoRA: SplitFed V1 with LoRA adapters on a language model, the client-side adapters averaged every
    ``aggregation_interval`` rounds (module docstring)."""

    name = "splitlora"
    description = "SplitLoRA: SplitFed with LoRA adapters on a language model, client adapters averaged every I rounds"
    tiers = ("it fine-tunes one split point's adapters (HSplitLoRA's per-client split points are a method of "
             "their own)")
    u_shape = ""
    Params = SplitLoRAParams
    checkpointed = ("trained",)

    def __init__(self, params, cfg):
        super().__init__(params, cfg)
        self.trained: list[int] = []  # clients that trained since the last aggregation

    @classmethod
    def check_config(cls, params, cfg) -> None:
        super().check_config(params, cfg)
        lm = cfg.model.lm
        if lm is None or lm.adapter.kind != "lora":
            raise ConfigError(f"algorithm={cls.name} fine-tunes LoRA adapters of a language model: set model.lm "
                              f"with model.lm.adapter.kind=lora" + ("" if lm is None else
                                                                    f" (got {lm.adapter.kind!r})"))
        if params.server_side == "shared" and params.batched_copies:
            raise ConfigError("algorithm.batched_copies batches per-client server copies; "
                              "algorithm.server_side=shared has one server-side model")

    def keeps_global_client_model(self) -> bool:
        # between aggregations each client's adapters are its own
        return self.params.aggregation_interval == 1

    def eval_modes(self) -> tuple[str, ...]:
        return ("global", "clients")

    def run_round(self, rt, rnd, clients, rng):
        if self.params.server_side == "shared":  # the code: one server model, one batch of each client in turn
            steps = {int(c): self.steps_for(rt, c) for c in clients}
            rt.split_steps([c for s in range(max(steps.values())) for c in steps if s < steps[c]])
        else:  # the paper: per-client server copies, averaged
            PSL.run_round(self, rt, rnd, clients, rng)
        self.trained = sorted(set(self.trained) | {int(c) for c in clients})
        if (rnd + 1) % self.params.aggregation_interval and rnd != self.cfg.train.rounds - 1:
            return None  # the last aggregate stays the global model
        weights = rt.weights(self.trained, self.agg.weights)
        self.trained = []
        if self.keeps_global_client_model():
            return rt.aggregate_clients(weights, self.agg.write_to)
        agg = rt.server.aggregate(*rt.workers.partial_sum(weights))
        every = list(range(rt.num_clients)) if self.agg.write_to == "all" else list(weights)
        rt.install(agg, receivers=clients, only=every)  # each client's own adapters: the aggregate
        rt.install(agg)  # and the global model, for a client that has not trained yet
        return agg
