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


@dataclass
class Activation:
    tag: Tag
    x: np.ndarray  # smashed data (transport.pack)
    y: np.ndarray  # labels (int64)
    t_sent: float  # simulated time at which the activation has reached the server
    weight: float = 1.0  # client's sample count (aggregation / loss weighting)

    @property
    def nbytes(self) -> int:
        return int(self.x.nbytes + self.y.nbytes)


@dataclass
class Batch:
    """A client's activation as a server hook sees it (:func:`raysplit.runtime.batch_step`): features and labels
    as tensors on the server's device, decoded from the wire by the runtime."""

    x: torch.Tensor  # features (an owned copy the step may change)
    y: torch.Tensor  # labels (int64)
    tag: Tag
    t_sent: float  # simulated time at which it reached the server
    weight: float = 1.0  # the client's sample count

    @property
    def client(self) -> int:
        return self.tag.client


@dataclass
class Gradient:
    tag: Tag
    g: np.ndarray | None  # dL/d(activation); None when the server sends nothing back
    t_sent: float  # simulated time at which the server finished and sent it
    loss: float = float("nan")
    rejected: str = ""  # why the server withheld this client's activation (``runtime.faults.on_bad_client: drop``)

    @property
    def nbytes(self) -> int:
        return int(self.g.nbytes) if self.g is not None else 0


@dataclass
class MiddleOut:
    """U-shaped split: the server's middle output for the activation of ``tag``, on its way to the client's tail."""

    tag: Tag
    z: np.ndarray  # the middle's output (transport.pack)
    t_sent: float  # simulated time at which the server finished and sent it

    @property
    def nbytes(self) -> int:
        return int(self.z.nbytes)


@dataclass
class TailGradient:
    """U-shaped split: the gradient of the client's loss with respect to the middle output of ``tag`` (what the
    client releases, after its label defence), its loss and when it left the client."""

    tag: Tag
    g: np.ndarray  # transport.pack
    t_sent: float
    loss: float

    @property
    def nbytes(self) -> int:
        return int(self.g.nbytes)


@dataclass
class StateMsg:
    """A model state moving between hosts (aggregation, hand-over); ``t_sent`` is when it left its sender."""

    state: dict
    t_sent: float = 0.0
    weight: float = 0.0
    loss: float = float("nan")  # an asynchronous client's mean training loss over the job it just finished
    rejected: str = ""  # the client was dropped during the job that produced this model: the server ignores it
    epsilon: float | None = None  # privacy.defence noise: the epsilon the client has spent so far (a measurement)

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


def batch_step(fn: Callable | None = None, *, stamp: bool = True) -> Callable:
    """Marks a server method that works on typed batches: the activations it is called with (the runtime's wire
    messages) arrive as :class:`Batch` es, tensors on the server's device, each an owned copy; arguments that are
    already batches (one hook calling another) and other arguments pass as they are. ``stamp``: the server waits
    for the last of them to arrive (its clock); off for a step that starts at an arrival of its own (``ready_at``).
    The method answers each batch with :meth:`ServerHost.answer` (its gradient as a tensor)."""

    def deco(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(self, *args, **kwargs):
            host = getattr(self, "host", self)  # a server rule's step: its host decodes and waits
            args = tuple(host.decode(a) if isinstance(a, Activation) else a for a in args)
            if stamp:
                arrived = [a.t_sent for a in args if isinstance(a, Batch)]
                if arrived:
                    host.wait_until(max(arrived))
            return f(self, *args, **kwargs)

        return wrapper

    return deco(fn) if fn is not None else deco
