"""Optimizers for client and server parts, built from the validated optimizer section (``train.optimizer``,
``train.server_optimizer``: :class:`~raysplit.config.OptimizerConfig`), and its per-round learning-rate schedule.
Pure torch (no Ray); the section's defaults are the config's own, read here as they are."""

from __future__ import annotations

import math

import torch


def make_optimizer(params, section) -> torch.optim.Optimizer:
    """The optimizer ``section`` names (sgd, adam or adamw, with its settings) over the trainable ``params``."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=section.lr)  # placeholder (Identity part)
    if section.name == "sgd":
        return torch.optim.SGD(params, lr=section.lr, momentum=section.momentum, weight_decay=section.weight_decay,
                               nesterov=section.nesterov)
    if section.name == "adam":
        return torch.optim.Adam(params, lr=section.lr, weight_decay=section.weight_decay)
    if section.name == "adamw":
        return torch.optim.AdamW(params, lr=section.lr, weight_decay=section.weight_decay)
    raise ValueError(f"unknown optimizer {section.name!r}")


def round_lr(section, rnd: int, rounds: int = 1) -> float:
    """Learning rate of round ``rnd`` of ``rounds``: ``exponential``: ``max(lr * decay**rnd, min_lr)`` (Hydra's
    per-epoch decay); ``cosine``: ``min_lr + (lr - min_lr) (1 + cos(pi rnd / rounds)) / 2`` (Semi-SFL's code)."""
    if section.schedule == "cosine":
        return section.min_lr + 0.5 * (section.lr - section.min_lr) * (
            1 + math.cos(math.pi * max(rnd, 0) / max(rounds, 1)))
    return max(section.lr * section.decay ** max(rnd, 0), section.min_lr)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
