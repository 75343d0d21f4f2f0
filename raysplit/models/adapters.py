"""What trains in a language model: LoRA adapters through ``peft``, or every weight.

:func:`apply_adapters` injects ``peft``'s LoRA layers into the library model in place (``inject_adapter_in_model``,
so the modules a :class:`~raysplit.models.causal_lm.CausalLM`'s blocks hold are the adapted ones) and freezes the
base: after it only the adapters require grad. ``kind: full`` leaves every weight trainable (full fine-tuning).

:func:`trainable_state` / :func:`load_trainable_state` are the state that aggregates, checkpoints and travels: the
trainable parameters of a model or of one of its parts (a client's or the server's Sequential), by name. With
LoRA that is the adapters alone; the frozen base is loaded once, from the same local source, by every side.

No Ray, no MLflow; ``peft`` is imported only when adapters are applied.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from raysplit.errors import ConfigError

__all__ = ["AdapterConfig", "DEFAULT_TARGETS", "apply_adapters", "trainable_state", "load_trainable_state"]

#: LoRA's default target modules per family: the attention projections SplitLoRA adapts (GPT-2's fused q/k/v
#: ``c_attn``; Llama's ``q_proj`` and ``v_proj``, as in the LoRA paper).
DEFAULT_TARGETS = {"gpt2": ("c_attn",), "llama": ("q_proj", "v_proj")}


class AdapterConfig(BaseModel):
    """``model.lm.adapter``: LoRA (rank, alpha, dropout, target modules) or full fine-tuning."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)

    kind: Literal["lora", "full"] = Field(default="lora", description="lora: only peft LoRA adapters train; full: "
                                          "every weight trains")
    rank: int = Field(default=8, ge=1, description="LoRA rank r")
    alpha: float = Field(default=16.0, gt=0, description="LoRA alpha (the update is scaled by alpha / rank)")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the LoRA branch's input")
    target_modules: list[str] | None = Field(default=None, description="module names LoRA adapts (null: the "
                                             "family's attention projections: gpt2 c_attn, llama q_proj v_proj)")


def apply_adapters(model, config: AdapterConfig) -> None:
    """Make ``config.kind``'s parameters the only trainable ones of ``model`` (a ``CausalLM``), in place."""
    hf_model = model.hf_model
    if config.kind == "full":
        for p in hf_model.parameters():
            p.requires_grad_(True)
        return
    from peft import LoraConfig, inject_adapter_in_model

    targets = list(config.target_modules or DEFAULT_TARGETS[model.family])
    names = {name.rsplit(".", 1)[-1] for name, _ in hf_model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ConfigError(f"model.lm.adapter.target_modules: {missing} are not modules of this {model.family} "
                          f"model; e.g. {sorted(n for n in names if n and not n.isdigit())[:12]}")
    lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                      target_modules=targets, fan_in_fan_out=model.family == "gpt2", bias="none")
    inject_adapter_in_model(lora, hf_model)
    model.refresh_blocks()  # a replaced module the blocks held directly (the LM head, the embeddings)
    for name, p in hf_model.named_parameters():
        p.requires_grad_("lora_" in name)


def trainable_state(module: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """The trainable parameters of ``module`` by name, detached copies on the CPU (what leaves a side)."""
    return OrderedDict((name, p.detach().to("cpu", copy=True)) for name, p in module.named_parameters()
                       if p.requires_grad)


@torch.no_grad()
def load_trainable_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` (from :func:`trainable_state` of the same kind of part) into ``module``'s trainable
    parameters; a missing, extra or misshapen entry is a ``ValueError`` naming it."""
    params = OrderedDict((name, p) for name, p in module.named_parameters() if p.requires_grad)
    missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or extra:
        raise ValueError(f"adapter state does not match the module: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, p in params.items():
        value = state[name]
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"adapter state {name!r} has shape {tuple(value.shape)}, the module {tuple(p.shape)}")
        p.copy_(value.to(device=p.device, dtype=p.dtype))
