"""What makes input unusable: a non-finite loss (the one rule, :func:`check_finite`), an activation or a gradient
that does not fit (``runtime.faults.on_bad_client``); the server's screen of what arrives is
:class:`~raysplit.runtime.server.screen.Screen`.

A check of values a device holds (a step's loss, a tensor's NaN/inf count) is made where the value is computed and
judged with the host's other such checks at the round's end (:class:`Deferred`: one read of the device a round),
unless the host must decide at once (``on_bad_client: drop``) or the values are host memory already (what
travelled between processes)."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from raysplit.runtime import transport
from raysplit.errors import BadClientInput
from raysplit.runtime.messages import Activation, Tag


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


class Deferred:
    """Checks of values a device holds (a step's loss, a count of NaN or inf values), made where the value is
    computed and judged together once a round (:meth:`settle`: one read, :func:`~raysplit.runtime.transport.
    read_floats`, so the step path never waits on the device), in the order they were made: the first judge that
    raises stops the rest. A plain float is judged with the others, in its place."""

    def __init__(self):
        self.checks: list[tuple] = []

    def add(self, value, judge: Callable[[float], None]) -> None:
        self.checks.append((value, judge))

    def settle(self) -> None:
        checks, self.checks = self.checks, []
        for (_, judge), v in zip(checks, transport.read_floats([v for v, _ in checks])):
            judge(v)

    def clear(self) -> None:
        self.checks = []


# where in a step a deferred check's value was made: a client step's activation reaches the server, a U-shaped
# tail's loss on the client, the server's loss, the gradient back at the client (the order of its failures)
ACTIVATION, TAIL_LOSS, LOSS, GRADIENT = range(4)


def ordered(exc: BaseException, order: tuple | None) -> BaseException:
    """``exc`` marked with where its value was made, ``(round, step, phase)``: of the failures judged at a round's end
    on several hosts, the runtime raises the earliest (:meth:`Runtime.end_round`)."""
    exc.order = order
    return exc


def check_loss(deferred: Deferred | None, loss, stop: bool, where: str, on_nonfinite: Callable[[], None] = None,
               order: tuple | None = None):
    """The finite check of a loss (:func:`check_finite`): a tensor's in ``deferred`` (read at the round's end), a
    float's now. ``on_nonfinite()``: called for a loss that is not finite, before it may raise; ``order``: where the
    loss was made (:func:`ordered`)."""
    def judge(v: float) -> None:
        if not math.isfinite(v) and on_nonfinite is not None:
            on_nonfinite()
        try:
            check_finite(v, stop, where)
        except NonFiniteLossError as e:
            raise ordered(e, order)

    if isinstance(loss, torch.Tensor) and deferred is not None:
        deferred.add(loss, judge)
    else:
        judge(float(loss))


def nonfinite_count(a):
    """How many values of ``a`` are NaN or inf: an int for an array, a 0-d tensor (not read) for a tensor."""
    if isinstance(a, torch.Tensor):
        return (~torch.isfinite(a.detach())).sum()
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def nonfinite_words(bad: int, size: int) -> str:
    return f"{bad} of {size} values are NaN or inf" if bad else ""


def nonfinite_fault(a, what: str) -> str:
    """``a``'s NaN/inf screen read now ('' if none; else ``"<what>: N of M values are NaN or inf"``): the
    immediate screen, where the host must decide at once or the values are host memory."""
    bad = int(nonfinite_count(a))
    return f"{what}: {nonfinite_words(bad, _size(a))}" if bad else ""


def _size(a) -> int:
    return a.nelement() if isinstance(a, torch.Tensor) else int(a.size)


def activation_form_fault(act: Activation, shape: tuple, dtype, num_classes: int, rnd: int | None,
                          label_shape: tuple = ()) -> str:
    """What is wrong with an activation's form ('' if nothing): everything :func:`activation_fault` checks but
    its values; nothing is read from a device (labels are host memory). ``label_shape``: a sample's labels (a
    language model's: its token block)."""
    x, y = act.x, np.asarray(act.y)
    if rnd is not None and act.tag.round != rnd:
        return f"tagged with round {act.tag.round}, the server is serving round {rnd}"
    if not isinstance(x, (np.ndarray, torch.Tensor)):
        return f"activation is a {type(x).__name__}, not an array"
    if transport.dtype_name(x) != np.dtype(dtype).name:
        return f"activation dtype {transport.dtype_name(x)}, expected {np.dtype(dtype).name}"
    if x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != tuple(shape) or x.shape[0] == 0:
        return f"activation shape {tuple(x.shape)}, expected (batch, {', '.join(map(str, shape))})"
    if y.size:
        if y.shape != (x.shape[0], *label_shape) or y.dtype.kind not in "iu":
            return f"labels of shape {y.shape} and dtype {y.dtype} for a batch of {x.shape[0]}"
        if label_shape:  # a language model's: a position may be no target (IGNORE_INDEX, E2E's masked prompts)
            from raysplit.data.text import IGNORE_INDEX

            y = y[y != IGNORE_INDEX]
        if y.size and (y.min() < 0 or y.max() >= num_classes):
            return f"labels out of range [0, {num_classes}): min {y.min()}, max {y.max()}"
    return ""


def activation_fault(act: Activation, shape: tuple, dtype: np.dtype, num_classes: int, rnd: int | None,
                     finite: bool = True) -> str:
    """What is wrong with an activation arriving at the server ('' if nothing): a tag from another round than
    ``rnd``, smashed data that is not an array of ``dtype`` with per-sample ``shape``, labels that do not match
    the batch (an empty label array is allowed: labels kept on the client) or lie outside ``[0, num_classes)``,
    non-finite values (when ``finite``: read now, where a tensor's are on a device)."""
    why = activation_form_fault(act, shape, dtype, num_classes, rnd)
    return why or (nonfinite_fault(act.x, "activation") if finite else "")


def gradient_form_fault(g, out: torch.Tensor) -> str:
    """What is wrong with a gradient's form for its activation ``out`` ('' if nothing; its values are not read)."""
    if not isinstance(g, (np.ndarray, torch.Tensor)):
        return f"gradient is a {type(g).__name__}, not an array"
    want = transport.dtype_name(out)
    if transport.dtype_name(g) != want or tuple(g.shape) != tuple(out.shape):
        return (f"gradient of shape {tuple(g.shape)} and dtype {transport.dtype_name(g)}, expected "
                f"{tuple(out.shape)} and {want}")
    return ""


def gradient_fault(g, out: torch.Tensor, finite: bool = True) -> str:
    """What is wrong with a gradient arriving at a client for its activation ``out`` ('' if nothing)."""
    return gradient_form_fault(g, out) or (nonfinite_fault(g, "gradient") if finite else "")


def defer_nonfinite(deferred: Deferred, a, what: str, raises: Callable[[str], Exception],
                    order: tuple | None = None) -> None:
    """The NaN/inf screen of a tensor ``a`` judged at the round's end: ``raises(why)`` is raised if it had any
    (``what``: "activation" or "gradient", as the immediate screen words it; ``order``: :func:`ordered`)."""
    size = _size(a)

    def judge(v: float) -> None:
        if v:
            raise ordered(raises(f"{what}: {nonfinite_words(int(v), size)}"), order)

    deferred.add(nonfinite_count(a), judge)


def screens_nonfinite(plan) -> bool:
    """NaN/inf inputs are screened unless the run lets them through (``train.stop_on_nonfinite: false`` with
    ``runtime.faults.on_bad_client: fail``: a diverging run goes on, as asked); ``plan``: the hosts'
    :class:`~raysplit.runtime.plan.HostPlan`."""
    return plan.sections.train.stop_on_nonfinite or plan.sections.runtime.faults.on_bad_client == "drop"


def where_of(tag: Tag) -> str:
    stream = f", stream {tag.stream}" if tag.stream != "main" else ""
    return f"client {tag.client}, round {tag.round}, step {tag.step}{stream}"


