"""Label privacy in a U-shaped split (building block: no Ray, no MLflow).

In a U-shaped split (``model.tail_cut``) the client keeps the model's first blocks (up to ``model.cut``) and its last
blocks (from ``model.tail_cut`` on) with the loss; the server trains the middle and never receives a label. What it
does receive, besides the activations, is the gradient of the client's loss with respect to the middle's output,
one row per sample, and that gradient carries the labels: Li et al., "Label Leakage and Protection in Two-party
Split Learning" (ICLR 2022), read them with two scores, both computed here from nothing but what the server
receives:

- **norm scoring** (their §3.2): a sample's score is the L2 norm of its gradient row. With cross-entropy the row is
  ``J^T (p - e_y)``; on an imbalanced binary task the minority class's rows are larger, so the norm ranks positives
  first.
- **direction scoring** (their §3.3): rows of the same class point the same way. The attacker is assumed to know
  the gradient of one sample of each class (their assumption: one known positive example); a sample's score for
  class ``k`` is the cosine similarity of its row with that class's reference row, and its predicted label the
  class of the most similar reference.

``leak_scores`` reports each as an AUC (binary: the positive class is label 1, as in the paper; more classes: one
class against the rest for every class that has samples of both kinds, averaged) and as label accuracy (direction:
the most similar reference's class; norm, binary tasks only: positive above the batch's mean norm, the threshold
an attacker without labels can set). The scores need the true labels to be *scored*, which only the client has:
the runtime computes them on the client host, on exactly the rows it released (after the defence), never sending a
label anywhere (raysplit/runtime/client/tail.py, raysplit/runtime/server/middle.py).

Defences on the released gradient (``privacy.label_defence``):

- ``noise``: isotropic Gaussian noise, per coordinate of standard deviation ``scale`` times the batch's median row
  norm divided by the square root of the row's size, so a row's noise has about ``scale`` times the median row's
  norm whatever the model, cut or stage of training (Li et al.'s noise baseline, made scale-free).
- ``max_norm``: Li et al.'s own heuristic defence (§4, "Max Norm"): every row gets Gaussian noise whose variance
  lifts its expected squared norm to the batch's largest, so that the norms no longer rank the classes; it has no
  parameter. Marvell (their §4, the optimised noise) is defined for binary tasks only and no maintained library
  that installs here implements it (SecretFlow's vertical-SL defences do not install on this stack); max norm is the
  simplest published defence against these attacks, from the same paper.

Both are drawn from the caller's random stream; ``noise`` at scale 0 returns the gradient itself (bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Union

import numpy as np
import torch
from pydantic import Field

from raysplit.privacy import AttackParams, DefenceParams


class LabelDefenceParams(DefenceParams):
    """A label defence's keys under ``privacy.label_defence``, picked by ``kind`` (strict and frozen as every
    privacy plug-in's section)."""

    KIND: ClassVar[str] = "label defence"


class NoLabelDefence(LabelDefenceParams):
    kind: Literal["none"] = Field(default="none", description="none: the gradient leaves the client as computed")


class LabelNoise(LabelDefenceParams):
    kind: Literal["noise"] = Field(description="noise: isotropic Gaussian noise on the returned gradient, a row's "
                                   "noise about scale x the batch's median row norm (Li et al. 2022's baseline)")
    scale: float = Field(ge=0, le=100, description="noise per row relative to the batch's median row norm "
                         "(0: none, bit for bit)")


class LabelMaxNorm(LabelDefenceParams):
    kind: Literal["max_norm"] = Field(description="max_norm: Li et al. 2022's heuristic: every row's noise lifts its "
                                      "expected norm to the batch's largest (no parameter)")


LABEL_DEFENCE_MODELS = (NoLabelDefence, LabelNoise, LabelMaxNorm)
LabelDefenceConfig = Annotated[Union[LABEL_DEFENCE_MODELS], Field(discriminator="kind")]  # noqa: UP007


class LabelAttackParams(AttackParams):
    """``privacy.label_attack``: which scores the server's label-leakage attack computes."""

    KIND: ClassVar[str] = "label attack"


class NoLabelAttack(LabelAttackParams):
    kind: Literal["none"] = Field(default="none", description="none: no label attack")


class GradientScoring(LabelAttackParams):
    kind: Literal["gradient_scoring"] = Field(description="gradient_scoring: Li et al. 2022's norm and direction "
                                              "scores of the returned gradients, per round: AUC and label accuracy "
                                              "(privacy/label_* metrics)")


class NextTokenScoring(LabelAttackParams):
    kind: Literal["next_token"] = Field(description="next_token: language models: the next tokens read from the "
                                        "returned gradients by their direction against the public LM head's rows, "
                                        "per round: top-1 and top-5 accuracy (privacy/next_token_leak, "
                                        "privacy/next_token_top5; raysplit/token_privacy.py)")
    scale_by_norm: bool = Field(default=True, description="scale the head's rows by the final norm's weight (the "
                                "rows as they reach the cut) before comparing directions")


LabelAttackConfig = Annotated[Union[NoLabelAttack, GradientScoring, NextTokenScoring],  # noqa: UP007
                              Field(discriminator="kind")]
LABEL_ATTACK_MODELS = (NoLabelAttack, GradientScoring, NextTokenScoring)


@dataclass(frozen=True)
class UShapeSpec:
    """A U-shaped split as the hosts get it: the tail's first block (``tail_cut``), the defence on the returned
    gradient and the label attack, and the number of classes the scores are over; for the ``next_token`` attack
    on a language model, ``head_rows``: the public base's LM head rows it compares directions with (scaled by the
    final norm's weight where ``scale_by_norm``)."""

    tail_cut: int
    defence: LabelDefenceParams
    attack: LabelAttackParams
    num_classes: int
    head_rows: np.ndarray | None = None  # next_token: the public LM head's rows (V, D), scaled by the norm's weight

    @property
    def scored(self) -> bool:
        return self.attack.kind != "none"


def defend_gradient(g: torch.Tensor, defence: LabelDefenceParams) -> torch.Tensor:
    """What the client returns instead of the gradient ``g`` (one row per sample), the noise drawn from torch's
    current random stream (the caller seeds it)."""
    if defence.kind == "none" or (defence.kind == "noise" and defence.scale == 0):
        return g
    rows = g.reshape(len(g), -1)
    norms = rows.norm(dim=1)
    d = rows.shape[1]
    if defence.kind == "noise":
        std = defence.scale * norms.median() / d ** 0.5
        return g + std * torch.randn_like(g)
    # max_norm: E||g_i + n_i||^2 = ||g_i||^2 + d sigma_i^2 = max_j ||g_j||^2
    sigma = ((norms.max() ** 2 - norms ** 2).clamp_min(0) / d).sqrt()
    return g + (sigma[:, None] * torch.randn_like(rows)).reshape(g.shape)


def _auc(score: np.ndarray, positive: np.ndarray) -> float | None:
    """ROC AUC of ``score`` for ``positive`` (scikit-learn's); None where one kind of sample is missing."""
    from sklearn.metrics import roc_auc_score

    if positive.all() or not positive.any():
        return None
    return float(roc_auc_score(positive, score))


def leak_scores(g: np.ndarray, y: np.ndarray, num_classes: int) -> dict[str, float]:
    """The label-leakage scores of released gradient rows ``g`` (n x d) of samples labelled ``y``: ``auc_norm``,
    ``auc_direction``, ``acc_direction`` and, on a binary task, ``acc_norm``. The direction scores' references are
    the first row of each class (the attacker's known sample), left out of what is scored; a class without a
    reference is not predicted. Keys are missing where they cannot be computed (one class only)."""
    g = np.asarray(g, dtype=np.float64).reshape(len(g), -1)
    y = np.asarray(y)
    out: dict[str, float] = {}
    norm = np.linalg.norm(g, axis=1)
    classes = [1] if num_classes == 2 else list(range(num_classes))
    aucs = [a for k in classes if (a := _auc(norm, y == k)) is not None]
    if aucs:
        out["auc_norm"] = float(np.mean(aucs))
    if num_classes == 2 and len(y):
        out["acc_norm"] = float(np.mean((norm > norm.mean()) == (y == 1)))
    first = {int(k): int(np.flatnonzero(y == k)[0]) for k in np.unique(y)}
    rest = np.setdiff1d(np.arange(len(y)), list(first.values()))
    if len(first) < 2 or not len(rest):
        return out
    ks = sorted(first)
    refs = g[[first[k] for k in ks]]
    unit = g[rest] / np.maximum(np.linalg.norm(g[rest], axis=1, keepdims=True), 1e-30)
    cos = unit @ (refs / np.maximum(np.linalg.norm(refs, axis=1, keepdims=True), 1e-30)).T  # (rest, refs)
    yr = y[rest]
    aucs = [a for i, k in enumerate(ks) if (num_classes > 2 or k == 1) and (a := _auc(cos[:, i], yr == k)) is not None]
    if aucs:
        out["auc_direction"] = float(np.mean(aucs))
    out["acc_direction"] = float(np.mean(np.asarray(ks)[cos.argmax(axis=1)] == yr))
    return out


def ushape_spec(model, cut: int | None, tail_cut, section, method: str, refusal: str, batched_copies: bool,
                num_classes: int):
    """``(UShapeSpec, client part, server part)`` for ``model.tail_cut`` (``tail_cut``; None: not U-shaped, and
    ``(None, None, None)``), checked before any actor starts: the method must run U-shaped (``refusal``: why not,
    its ``Algorithm.u_shape``), the tail cut must come after ``cut`` and leave the client a tail, and a label attack
    or defence (``section``: the ``privacy`` config section) needs the U-shape, since otherwise the server has the
    labels."""
    from raysplit.errors import ConfigError

    on = [k for k in ("label_attack", "label_defence") if getattr(section, k).kind != "none"]
    if tail_cut is None:
        if on:
            how = ("model.lm.split=u_shaped" if getattr(model, "hf_model", None) is not None else
                   "model.tail_cut for a U-shaped split")
            raise ConfigError(f"privacy.{on[0]}.kind={getattr(section, on[0]).kind}: {method} sends the labels to "
                              f"the server, which has no need to read them from gradients; set {how}, where the "
                              f"labels stay on the clients")
        return None, None, None
    if cut is None:
        raise ConfigError(f"model.tail_cut={tail_cut!r}: {method} has no split: the whole model and the labels stay "
                          f"on the clients")
    if refusal:
        raise ConfigError(f"model.tail_cut={tail_cut!r}: {refusal.format(name=method)}")
    if batched_copies:
        raise ConfigError(f"model.tail_cut={tail_cut!r}: algorithm.batched_copies steps the server copies in one "
                          f"batched computation, which a U-shaped split's two exchanges per step do not take; set "
                          f"algorithm.batched_copies=false")
    try:
        tail = model.resolve_cut(tail_cut)
    except ValueError as e:
        raise ConfigError(f"model.tail_cut: {e}") from None
    if tail <= cut:
        names = {i: n for n, i in model.cut_points().items()}
        raise ConfigError(f"model.tail_cut={tail_cut!r} (after block {tail}) does not come after model.cut (after "
                          f"block {cut}, {names.get(cut, cut)!r}): the server would hold no block; valid tail cuts "
                          f"here: {', '.join(repr(names.get(i, i)) for i in range(cut + 1, len(model.blocks)))}")
    attack, rows = section.label_attack, None
    from raysplit.models.causal_lm import CausalLM

    language_model = isinstance(model, CausalLM)
    if attack.kind == "gradient_scoring" and language_model:
        raise ConfigError("privacy.label_attack.kind=gradient_scoring scores one class label per sample; a language "
                          "model's labels are its next tokens: use privacy.label_attack.kind=next_token")
    if attack.kind == "next_token":
        if not language_model:
            raise ConfigError(f"privacy.label_attack.kind=next_token reads next tokens against a language model's "
                              f"LM head (model.lm); {type(model).__name__} is not one: use gradient_scoring")
        if tail != len(model.blocks) - 1:
            names = {i: n for n, i in model.cut_points().items()}
            raise ConfigError(f"model.tail_cut={tail_cut!r}: privacy.label_attack.kind=next_token compares the "
                              f"returned gradient with the LM head's rows, which needs the client's tail to be "
                              f"the head alone (model.tail_cut={names[len(model.blocks) - 1]!r}, the default); "
                              f"here the tail holds decoder blocks too")
        from raysplit.token_privacy import head_rows

        w, norm_w = head_rows(model.blocks[-1])
        if attack.scale_by_norm and norm_w is not None:
            w = w * norm_w
        rows = np.ascontiguousarray(w.float().numpy())
    client, server = model.split_u(cut, tail)
    return UShapeSpec(tail, section.label_defence, attack, num_classes, rows), client, server
