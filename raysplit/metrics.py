"""Classification metrics and forgetting measures (building block: no Ray, no MLflow).

Accuracy, macro-F1 and MCC come from scikit-learn. Performance gap and backward transfer follow Hydra
(seed-code.md §2.5): PG = max_l a_l - mean_l a_l; BW = mean over labels of (peak accuracy in the kept history
minus final accuracy). Labels with no test samples are excluded (Hydra's code counts them as -1; we do not).
"""

from __future__ import annotations

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
