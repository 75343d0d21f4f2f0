"""Plots saved as run artifacts (matplotlib, Agg backend)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_curves(history: dict[str, list[tuple[int, float]]], path: str, title: str = "") -> None:
    keys = [k for k in ("accuracy", "perplexity", "loss", "train_loss", "f1_macro") if history.get(k)]
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4 * max(len(keys), 1), 3.2))
    axes = np.atleast_1d(axes)
    for ax, k in zip(axes, keys):
        xs, ys = zip(*history[k])
        ax.plot(xs, ys)
        ax.set_xlabel("round"), ax.set_title(k), ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_label_heatmap(rounds: list[int], label_acc: np.ndarray, path: str, title: str = "") -> None:
    """Per-label accuracy (labels x evaluations)."""
    a = np.asarray(label_acc, dtype=float)
    fig, ax = plt.subplots(figsize=(min(14, 3 + 0.15 * len(rounds)), min(10, 1.5 + 0.3 * a.shape[1])))
    im = ax.imshow(a.T, aspect="auto", origin="lower", vmin=0, vmax=1, cmap="viridis",
                   extent=(rounds[0] - 0.5, rounds[-1] + 0.5, -0.5, a.shape[1] - 0.5))
    ax.set_xlabel("round"), ax.set_ylabel("label"), ax.set_title(title or "per-label test accuracy")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_positions(rounds: list[int], pos_acc: np.ndarray, labels: list[int], path: str, title: str = "") -> None:
    """Per-position accuracy over rounds (one line per position in the processing cycle)."""
    a = np.asarray(pos_acc, dtype=float)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    cmap = plt.get_cmap("viridis", max(a.shape[1], 2))
    for i, lab in enumerate(labels):
        ax.plot(rounds, a[:, i], color=cmap(i), lw=1.2, label=f"pos {i + 1} (label {lab})")
    ax.set_xlabel("round"), ax.set_ylabel("test accuracy of the position's label"), ax.grid(alpha=0.3)
    ax.set_title(title or "per-position accuracy")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_reconstructions(pairs: list[tuple[np.ndarray, np.ndarray]], path: str, title: str = "") -> None:
    """A grid of images: per victim client, a row of its inputs and below it the attacker's reconstructions
    (``pairs``: per client (inputs, reconstructions), each (n, channels, height, width)); each image scaled to
    its own range. Colour images are shown as RGB, others by their first channel."""
    rows = [img for x, r in pairs for img in (x, r)]
    n = max(len(r) for r in rows)
    fig, axes = plt.subplots(len(rows), n, figsize=(1.1 * n, 1.15 * len(rows)), squeeze=False)
    for i, imgs in enumerate(rows):
        for j in range(n):
            ax = axes[i][j]
            ax.axis("off")
            if j < len(imgs):
                im = imgs[j].astype(float)
                im = (im - im.min()) / max(im.max() - im.min(), 1e-12)
                ax.imshow(im.transpose(1, 2, 0) if im.shape[0] == 3 else im[0], cmap=None if im.shape[0] == 3
                          else "gray")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
