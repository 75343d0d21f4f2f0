"""Messages exchanged between client hosts and the server host. Pairing is by ``Tag``, never by arrival order."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from raysplit.runtime import transport


@dataclass(frozen=True, order=True)
class Tag:
    client: int
    round: int
    step: int
    stream: str = "main"  # e.g. "student"/"teacher": several feature streams per client step, paired apart


class Staged:
    """A message whose tensor fields (``STAGED``) stay tensors in process and are staged once when the message is
    pickled to leave it (:func:`~raysplit.runtime.transport.stage`: numpy arrays, a 0-d loss as a float)."""

    STAGED: tuple[str, ...] = ()

    def __getstate__(self) -> dict:  # what pickling (Ray, a checkpoint, a copy) writes: the fields, staged
        return {k: (transport.stage(v) if k in self.STAGED else v) for k, v in vars(self).items()}


@dataclass
class Activation(Staged):
    """What a client's forward sends: features (the client part's output), labels (empty where they stay on the
    client), when it reached the server and the client's sample count."""

    STAGED = ("x", "y")
    tag: Tag
    x: torch.Tensor | np.ndarray  # smashed data: the sender's detached tensor in process, numpy once it travelled
    y: torch.Tensor | np.ndarray  # labels (int64)
    t_sent: float  # simulated time at which the activation has reached the server
    weight: float = 1.0  # client's sample count (aggregation / loss weighting)

    @property
    def nbytes(self) -> int:
        return transport.nbytes(self.x) + transport.nbytes(self.y)


@dataclass
class Batch:
    """A client's activation as a server hook sees it (:func:`raysplit.runtime.batch_step`): features and labels
    as tensors on the server's device. In process the features are the client's own tensor (detached: no copy), so a
    step must not change them in place; one that travelled is a copy of its own."""

    x: torch.Tensor  # features
    y: torch.Tensor  # labels (int64)
    tag: Tag
    t_sent: float  # simulated time at which it reached the server
    weight: float = 1.0  # the client's sample count

    @property
    def client(self) -> int:
        return self.tag.client

    @classmethod
    def of(cls, act: "Activation", device) -> "Batch":
        """An arrived activation as a batch on ``device``: a tensor handed over as it is, an array that travelled as
        an owned, writable copy."""
        return cls(transport.unpack(act.x, device, writable=True), transport.labels(act.y, device), act.tag,
                   act.t_sent, act.weight)


@dataclass
class Gradient(Staged):
    STAGED = ("g", "loss")
    tag: Tag
    g: torch.Tensor | np.ndarray | None  # dL/d(activation); None when the server sends nothing back
    t_sent: float  # simulated time at which the server finished and sent it
    loss: float | torch.Tensor = float("nan")  # the step's loss (a 0-d tensor in process: read once a round)
    rejected: str = ""  # why the server withheld this client's activation (``runtime.faults.on_bad_client: drop``)

    @property
    def nbytes(self) -> int:
        return transport.nbytes(self.g) if self.g is not None else 0


@dataclass
class MiddleOut(Staged):
    """U-shaped split: the server's middle output for the activation of ``tag``, on its way to the client's tail."""

    STAGED = ("z",)
    tag: Tag
    z: torch.Tensor | np.ndarray  # the middle's output
    t_sent: float  # simulated time at which the server finished and sent it

    @property
    def nbytes(self) -> int:
        return transport.nbytes(self.z)


@dataclass
class TailGradient(Staged):
    """U-shaped split: the gradient of the client's loss with respect to the middle output of ``tag`` (what the
    client releases, after its label defence), its loss and when it left the client."""

    STAGED = ("g", "loss")
    tag: Tag
    g: torch.Tensor | np.ndarray
    t_sent: float
    loss: float | torch.Tensor

    @property
    def nbytes(self) -> int:
        return transport.nbytes(self.g)


@dataclass
class StateMsg:
    """A model state moving between hosts (aggregation, hand-over); ``t_sent`` is when it left its sender."""

    state: dict
    t_sent: float = 0.0
    weight: float = 0.0
    loss: float = float("nan")  # an asynchronous client's mean training loss over the job it just finished
    rejected: str = ""  # the client was dropped during the job that produced this model: the server ignores it
    epsilon: float | None = None  # privacy.defence noise: the epsilon the client has spent so far (a measurement)
    held: dict | None = None  # a tiered partial sum: per key, the weight of the clients holding it (runtime/tiered.py)

    @classmethod
    def packed(cls, state: dict[str, torch.Tensor], **kw) -> StateMsg:
        """A message carrying ``state`` (tensors) in the wire format."""
        return cls(transport.pack_state(state), **kw)

    def tensors(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The carried state as tensors."""
        return transport.unpack_state(self.state, device)

    @property
    def nbytes(self) -> int:
        return transport.state_nbytes(self.state)


STARTS = ("on_arrival", "after_last_arrival")  # when a server step may start: batch_step(starts=...)


def batch_step(fn: Callable | None = None, *, starts: str) -> Callable:
    """Marks a server step that works on typed batches: the activations it is given (the runtime's wire messages)
    reach it as :class:`Batch` es, tensors on the server's device, each an owned copy (the server host decodes them,
    :meth:`~raysplit.runtime.server.host.ServerHost.serve`); batches given by another step pass as they are.
    ``starts`` says when the step may start on the server's clock: ``"after_last_arrival"``, once the last of its
    batches has arrived (the server waits for it first); ``"on_arrival"``, each batch's work from that batch's own
    arrival on (the trainer charges it from ``Batch.t_sent``: a step over several clients' batches that serves them
    one by one, or a step that times itself). The step answers each batch (``ctx.trainer.train``,
    ``ctx.trainer.gradient`` or ``ctx.trainer.answer``)."""
    if starts not in STARTS:
        raise ValueError(f"batch_step(starts={starts!r}): give one of {', '.join(STARTS)}")

    def deco(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(self, *args, **kwargs):
            if starts == "after_last_arrival":
                arrived = [a.t_sent for a in args if isinstance(a, Batch)]
                if arrived:
                    trainer = self.ctx.trainer if hasattr(self, "ctx") else self.trainer  # a rule's, or a host's
                    trainer.wait_until(max(arrived))
            return f(self, *args, **kwargs)

        wrapper.starts = starts
        return wrapper

    return deco(fn) if fn is not None else deco


def step_timing(fn: Callable) -> str | None:
    """When a server step marked with :func:`batch_step` may start (None: not a step over batches)."""
    return getattr(fn, "starts", None)
