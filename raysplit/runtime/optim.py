"""Optimizers for client and server parts, built from the validated ``train.optimizer`` section, and the
per-round learning-rate schedule. Pure torch (no Ray)."""

from __future__ import annotations

import math

import torch


def make_optimizer(params, cfg: dict) -> torch.optim.Optimizer:
    """``cfg`` is ``OptimizerConfig.model_dump()``: name sgd | adam | adamw with its settings."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg["lr"])  # placeholder (Identity part)
    if cfg["name"] == "sgd":
        return torch.optim.SGD(params, lr=cfg["lr"], momentum=cfg.get("momentum", 0.0),
                               weight_decay=cfg.get("weight_decay", 0.0), nesterov=cfg.get("nesterov", False))
    if cfg["name"] == "adam":
        return torch.optim.Adam(params, lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.0))
    if cfg["name"] == "adamw":
        return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.0))
    raise ValueError(f"unknown optimizer {cfg['name']!r}")


def round_lr(cfg: dict, rnd: int, rounds: int = 1) -> float:
    """Learning rate of round ``rnd`` of ``rounds``: ``exponential`` (default): ``max(lr * decay**rnd, min_lr)``
    (Hydra's per-epoch decay); ``cosine``: ``min_lr + (lr - min_lr) (1 + cos(pi rnd / rounds)) / 2`` (Semi-SFL's
    code)."""
    if cfg.get("schedule", "exponential") == "cosine":
        return cfg.get("min_lr", 0.0) + 0.5 * (cfg["lr"] - cfg.get("min_lr", 0.0)) * (
            1 + math.cos(math.pi * max(rnd, 0) / max(rounds, 1)))
    return max(cfg["lr"] * cfg.get("decay", 1.0) ** max(rnd, 0), cfg.get("min_lr", 0.0))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
