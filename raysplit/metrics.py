"""Classification metrics and forgetting measures (building block: no Ray, no MLflow).

Accuracy, macro-F1 and MCC come from scikit-learn. Performance gap and backward transfer follow Hydra
(seed-code.md §2.5): PG = max_l a_l - mean_l a_l; BW = mean over labels of (peak accuracy in the kept history
minus final accuracy). Labels with no test samples are excluded (Hydra's code counts them as -1; we do not).
"""

from __future__ import annotations

import re

import numpy as np
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef


def per_label_accuracy(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> np.ndarray:
    """Accuracy per label; NaN for labels absent from y_true."""
    y_true = np.asarray(y_true)
    y_pred = np.asarray(y_pred)
    correct = np.bincount(y_true[y_true == y_pred], minlength=num_classes).astype(float)
    total = np.bincount(y_true, minlength=num_classes).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, correct / np.maximum(total, 1), np.nan)


def performance_gap(label_acc: np.ndarray) -> float:
    a = np.asarray(label_acc, dtype=float)
    a = a[~np.isnan(a)]
    return float(a.max() - a.mean()) if a.size else float("nan")


def backward_transfer(history: np.ndarray) -> float:
    """Mean over labels of (max over earlier evaluations - final); history is (evaluations, labels)."""
    h = np.asarray(history, dtype=float)
    if h.ndim != 2 or h.shape[0] < 2:
        return 0.0
    final = h[-1]
    peak = np.nanmax(h[:-1], axis=0)
    drop = peak - final
    drop = drop[~np.isnan(drop)]
    return float(drop.mean()) if drop.size else float("nan")


def position_accuracy(label_acc, labels) -> np.ndarray:
    """Per-position accuracy (Hydra §3.1) for cyclic processing: position i reports the accuracy of the label
    dominant at the clients served at position i of a cycle, ``labels[i]``. Works on one evaluation or a
    history (last axis = labels)."""
    return np.asarray(label_acc, dtype=float)[..., list(labels)]


def classification_metrics(y_true, y_pred, num_classes: int, loss_sum: float | None = None) -> dict:
    """loss, accuracy, macro-F1, MCC, per-label accuracy and performance gap for one evaluation."""
    y_true = np.asarray(y_true)
    y_pred = np.asarray(y_pred)
    label_acc = per_label_accuracy(y_true, y_pred, num_classes)
    out = {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "f1_macro": float(f1_score(y_true, y_pred, average="macro", labels=np.unique(y_true), zero_division=0)),
        "mcc": float(matthews_corrcoef(y_true, y_pred)) if len(np.unique(y_true)) > 1 else 0.0,
        "performance_gap": performance_gap(label_acc),
        "label_accuracy": label_acc,
    }
    if loss_sum is not None:
        out["loss"] = float(loss_sum / max(len(y_true), 1))
    return out


def mean_std(values) -> tuple[float, float]:
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std())


# A run's metrics are named by group, as MLflow groups its charts (the prefix before the first "/"): eval/ (the
# evaluation), train/ (the round's training), comm/ (bytes sent), compute/ (FLOPs), time/ (simulated and wall-clock
# seconds), summary/ (logged once, at the end) and method/ (what one algorithm adds: Semi-SFL's ks, GAS's
# generated_activations ...). Hosts and algorithms produce the short names below; ``grouped`` renames them where a
# run's metrics leave it (MLflow, Tune, ``on_round``, ``run_experiment``'s result, the golden fingerprints).
GROUPED = {
    "accuracy": "eval/accuracy", "best_accuracy": "eval/best_accuracy", "f1_macro": "eval/f1_macro",
    "mcc": "eval/mcc", "loss": "eval/loss", "performance_gap": "eval/performance_gap",
    "perplexity": "eval/perplexity", "next_token_accuracy": "eval/next_token_accuracy", "tokens": "eval/tokens",
    "bleu": "eval/bleu", "rouge_l": "eval/rouge_l", "train_tokens": "train/tokens",
    "tokens_per_s": "train/tokens_per_s", "bytes_per_token": "comm/bytes_per_token",
    "backward_transfer": "eval/backward_transfer", "rounds_to_target": "eval/rounds_to_target",
    "validation_accuracy": "eval/validation_accuracy", "validation_loss": "eval/validation_loss",
    "validation_perplexity": "eval/validation_perplexity",
    "train_loss": "train/loss", "grad_norm_mean": "train/grad_norm_mean", "grad_norm_std": "train/grad_norm_std",
    "dropped_clients": "train/dropped_clients",
    "client_flops": "compute/client_flops", "server_flops": "compute/server_flops",
    "sim_time": "time/sim", "sim_time_round": "time/sim_round", "wall_time": "time/wall",
    "wall_time_round": "time/wall_round", "server_busy_s": "time/server_busy",
    "final_best_accuracy": "summary/best_accuracy", "grad_norm_mean_all": "summary/grad_norm_mean",
    "grad_norm_std_all": "summary/grad_norm_std", "sim_time_total": "summary/sim_time",
    "wall_time_total": "summary/wall_time",
}
# the metrics that measure the machine rather than the method: left out wherever two runs are held to the same numbers
WALL_CLOCK = frozenset({"time/wall", "time/wall_round", "time/server_busy", "summary/wall_time",
                        "train/tokens_per_s"})
_PATTERNS = [(re.compile(r"label_acc_(\d+)"), r"eval/label_acc/\1"),
             (re.compile(r"position_acc_(\d+)"), r"eval/position_acc/\1"),
             (re.compile(r"(bytes_\w+)"), r"comm/\1")]
_SHORT = {v: k for k, v in GROUPED.items()}


def grouped_name(name: str) -> str:
    """The grouped name of a metric: ``accuracy`` -> ``eval/accuracy``, ``label_acc_3`` -> ``eval/label_acc/3``,
    ``bytes_up`` -> ``comm/bytes_up``, a method's own ``ks`` -> ``method/ks``; a name with a "/" is kept. Also the
    one-release alias for stores written before the groups: an old name given where a grouped one is expected."""
    if "/" in name:
        return name
    if name in GROUPED:
        return GROUPED[name]
    for pattern, repl in _PATTERNS:
        if pattern.fullmatch(name):
            return pattern.sub(repl, name)
    return f"method/{name}"


def short_name(name: str) -> str:
    """The name a metric had before the groups (``grouped_name``'s inverse): what stores written before hold."""
    if name in _SHORT:
        return _SHORT[name]
    group, _, rest = name.partition("/")
    if group == "eval" and "/" in rest:
        return rest.replace("/", "_")
    return rest if group in ("comm", "method") else name


def grouped(metrics: dict) -> dict:
    """``metrics`` with every name grouped (``grouped_name``), values and order unchanged."""
    return {grouped_name(k): v for k, v in metrics.items()}
