"""What trains in a language model: LoRA adapters through ``peft``, or every weight.

:func:`apply_adapters` injects ``peft``'s LoRA layers into the library model in place (``inject_adapter_in_model``,
so the modules a :class:`~raysplit.models.causal_lm.CausalLM`'s blocks hold are the adapted ones) and freezes the
base: after it only the adapters require grad. ``kind: full`` leaves every weight trainable (full fine-tuning).

:func:`trainable_state` / :func:`load_trainable_state` are the state that aggregates, checkpoints and travels: the
trainable parameters of a model or of one of its parts (a client's or the server's Sequential), by name. With
LoRA that is the adapters alone; the frozen base is loaded once, from the same local source, by every side.

**Adapter-only blocks.** With LoRA, every block of the model is marked adapter-only (:func:`mark_adapter_only`):
its ``state_dict()`` holds its trainable parameters only (the adapters, and whatever ``trainable_modules`` keeps
training), and ``load_state_dict`` leaves its frozen tensors as they are (missing from the state, or given: the
base is the one built from its source, never a message's). So whatever takes a part's ``state_dict`` (the
runtime's model transfers, FedAvg-style averaging, the server's per-client copies, snapshots and checkpoints)
moves, averages and saves the adapters alone, as SplitLoRA (Lin et al., arXiv 2407.00952) trains and aggregates
only the LoRA adapters; the hooks sit on the blocks, so any container of them (a split's parts, a U-shaped
client, a tiered client part) follows. With ``kind: full`` nothing is marked: every weight trains, travels and
aggregates, as for the zoo's models.

:func:`copy_sharing_base` copies a module whose adapter-only blocks' frozen tensors stay shared (the same storage,
``data_ptr``): the clients an actor hosts, and the server's per-client copies, each get their own adapters over
one frozen base (a module without adapter-only blocks is copied whole, as ``copy.deepcopy`` does).

No Ray, no MLflow; ``peft`` is imported only when adapters are applied.
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from typing import Iterator, Literal, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from raysplit.errors import ConfigError

__all__ = ["AdapterConfig", "DEFAULT_TARGETS", "apply_adapters", "base_digest", "copy_sharing_base",
           "frozen_tensors", "is_adapter_only", "mark_adapter_only", "trainable_state", "load_trainable_state"]

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
    trainable_modules: list[str] = Field(default=[], description="lora: module names whose own weights train "
                                         "(and travel, aggregate, checkpoint) beside the adapters, e.g. [ln_f] "
                                         "(peft's modules_to_save); the rest of the base stays frozen")


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
    keep = list(config.trainable_modules)
    unknown = [t for t in keep if t not in names]
    if unknown:
        raise ConfigError(f"model.lm.adapter.trainable_modules: {unknown} are not modules of this {model.family} "
                          f"model; e.g. {sorted(n for n in names if n and not n.isdigit())[:12]}")
    inject_adapter_in_model(lora, hf_model)
    model.refresh_blocks()  # a replaced module the blocks held directly (the LM head, the embeddings)
    for name, p in hf_model.named_parameters():
        parts = name.split(".")
        p.requires_grad_("lora_" in name or any(t in parts[:-1] for t in keep))
    mark_adapter_only(model)


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


# ----------------------------------------------------------------------------------------------------------------
# Adapter-only blocks: what their state is, and copies over one frozen base
# ----------------------------------------------------------------------------------------------------------------
def mark_adapter_only(model) -> None:
    """Mark every block of ``model`` (a ``CausalLM`` with adapters) adapter-only: its ``state_dict()`` is its
    trainable parameters, and ``load_state_dict`` keeps its frozen tensors (see the module docstring)."""
    for block in model.blocks:
        if not getattr(block, "adapter_only", False):
            block.adapter_only = True
            block.register_state_dict_post_hook(_drop_frozen)
            block.register_load_state_dict_pre_hook(_keep_frozen)


def is_adapter_only(module: nn.Module) -> bool:
    """Whether ``module`` holds an adapter-only block (its state is then its trainable parameters)."""
    return any(getattr(m, "adapter_only", False) for m in module.modules())


def _frozen_entries(block: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each frozen state entry of ``block``: its parameters that do not require grad and its
    persistent buffers, under every name the state dict has them (a tied weight under each)."""
    for mod_name, mod in block.named_modules(remove_duplicate=False):
        pre = f"{mod_name}." if mod_name else ""
        for name, p in mod._parameters.items():
            if p is not None and not p.requires_grad:
                yield pre + name, p
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield pre + name, b


def _drop_frozen(module, state_dict, prefix, local_metadata) -> None:
    for name, _ in _frozen_entries(module):
        state_dict.pop(prefix + name, None)


def _keep_frozen(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
    for name, t in _frozen_entries(module):  # loads each frozen tensor onto itself: a no-op copy
        state_dict[prefix + name] = t.detach()


def frozen_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The frozen tensors (parameters and buffers) of ``module``'s adapter-only blocks, each once."""
    seen: dict[int, torch.Tensor] = {}
    for m in module.modules():
        if getattr(m, "adapter_only", False):
            for _, t in _frozen_entries(m):
                seen.setdefault(id(t), t)
            for _, b in m.named_buffers():  # non-persistent buffers (rotary tables) are the base's too
                seen.setdefault(id(b), b)
    return list(seen.values())


def copy_sharing_base(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose adapter-only blocks' frozen tensors share the original's storage: a new
    ``Parameter`` object over the same data (so moving one copy, ``.to``, moves that copy only), buffers the same
    tensors; the adapters, and any other trainable weight, are the copy's own. Without adapter-only blocks:
    ``copy.deepcopy(module)``."""
    memo: dict[int, object] = {}
    for t in frozen_tensors(module):
        memo[id(t)] = nn.Parameter(t.data, requires_grad=False) if isinstance(t, nn.Parameter) else t
    return copy.deepcopy(module, memo)


def base_digest(module: nn.Module) -> str:
    """A fingerprint of ``module``'s frozen base (every side must build the same one): per frozen tensor its
    name, shape, dtype, its float64 sum and its first and last 4096 elements' bytes, hashed. Cheap next to the
    weights' size; it catches a different source directory, seed or library version, not a single changed bit
    deep inside a tensor."""
    h = hashlib.sha256()
    ids = {id(t) for t in frozen_tensors(module)}
    for name, t in _named_frozen(module, ids):
        flat = t.detach().reshape(-1)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{float(flat.double().sum()):.17g}".encode())
        for piece in (flat[:4096], flat[-4096:]):
            h.update(piece.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _named_frozen(module: nn.Module, ids: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in module.named_parameters():
        if id(t) in ids:
            yield name, t
    for name, t in module.named_buffers():
        if id(t) in ids:
            yield name, t
