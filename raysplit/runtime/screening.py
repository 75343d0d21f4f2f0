"""What makes input unusable: a non-finite loss (the one rule, :func:`check_finite`), an activation or a gradient
that does not fit (``runtime.faults.on_bad_client``); the server's screen of what arrives is
:class:`~raysplit.runtime.server.screen.Screen`."""

from __future__ import annotations

import inspect
import math
from typing import Callable

import numpy as np
import torch

from raysplit.runtime import transport
from raysplit.errors import BadClientInput
from raysplit.runtime.messages import Activation, Gradient, Tag


class NonFiniteLossError(RuntimeError):
    """A loss became NaN or inf; the message names the round and client."""


class NonFiniteInput(NonFiniteLossError, BadClientInput):
    """A NaN or inf activation or gradient under ``on_bad_client: fail``: a client's fault and, like a non-finite
    loss, what a diverged run shows (a sweep reports it as diverged, not as a failure to retry)."""


def bad_input(where: str, why: str) -> BadClientInput:
    return (NonFiniteInput if "NaN or inf" in why else BadClientInput)(f"{where}: {why}")


def check_finite(loss: float, stop: bool, where: str) -> bool:
    """True if ``loss`` is finite; otherwise raise (``stop``, i.e. ``train.stop_on_nonfinite``) or return False."""
    if math.isfinite(loss):
        return True
    if stop:
        raise NonFiniteLossError(f"non-finite loss {loss} at {where}")
    return False


def _nonfinite(a: np.ndarray) -> str:
    bad = int(a.size - np.count_nonzero(np.isfinite(a)))
    return f"{bad} of {a.size} values are NaN or inf" if bad else ""


def activation_fault(act: Activation, shape: tuple, dtype: np.dtype, num_classes: int, rnd: int | None,
                     finite: bool = True) -> str:
    """What is wrong with an activation arriving at the server ('' if nothing): a tag from another round than
    ``rnd``, smashed data that is not an array of ``dtype`` with per-sample ``shape``, labels that do not match
    the batch (an empty label array is allowed: labels kept on the client) or lie outside ``[0, num_classes)``,
    non-finite values (when ``finite``)."""
    x, y = act.x, np.asarray(act.y)
    if rnd is not None and act.tag.round != rnd:
        return f"tagged with round {act.tag.round}, the server is serving round {rnd}"
    if not isinstance(x, np.ndarray):
        return f"activation is a {type(x).__name__}, not an array"
    if x.dtype != dtype:
        return f"activation dtype {x.dtype}, expected {dtype}"
    if x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != tuple(shape) or x.shape[0] == 0:
        return f"activation shape {tuple(x.shape)}, expected (batch, {', '.join(map(str, shape))})"
    if y.size:
        if y.shape != (x.shape[0],) or y.dtype.kind not in "iu":
            return f"labels of shape {y.shape} and dtype {y.dtype} for a batch of {x.shape[0]}"
        if y.min() < 0 or y.max() >= num_classes:
            return f"labels out of range [0, {num_classes}): min {y.min()}, max {y.max()}"
    return finite and _nonfinite(x) and "activation: " + _nonfinite(x)


def gradient_fault(g: np.ndarray, out: torch.Tensor, finite: bool = True) -> str:
    """What is wrong with a gradient arriving at a client for its activation ``out`` ('' if nothing)."""
    if not isinstance(g, np.ndarray):
        return f"gradient is a {type(g).__name__}, not an array"
    want = transport.pack(out[:0]).dtype
    if g.dtype != want or tuple(g.shape) != tuple(out.shape):
        return f"gradient of shape {tuple(g.shape)} and dtype {g.dtype}, expected {tuple(out.shape)} and {want}"
    return finite and _nonfinite(g) and "gradient: " + _nonfinite(g)


def screens_nonfinite(plan) -> bool:
    """NaN/inf inputs are screened unless the run lets them through (``train.stop_on_nonfinite: false`` with
    ``runtime.faults.on_bad_client: fail``: a diverging run goes on, as asked); ``plan``: the hosts'
    :class:`~raysplit.runtime.plan.HostPlan`."""
    return plan.sections.train.stop_on_nonfinite or plan.sections.runtime.faults.on_bad_client == "drop"


def where_of(tag: Tag) -> str:
    stream = f", stream {tag.stream}" if tag.stream != "main" else ""
    return f"client {tag.client}, round {tag.round}, step {tag.step}{stream}"


