"""How tensors travel between hosts: one place, chosen by measurement.

**In one process** (the local backend) hosts hand each other tensors: an activation, a gradient, a middle output is
the sender's own tensor (detached), on its device, with no copy and no host synchronisation; the receiver computes
on it as it is. **Between processes** (Ray) a message stages its tensors once, when it is pickled (its
``__getstate__``, :func:`stage`): to numpy arrays on the host, because on this stack torch tensors cross Ray's object
store as serialized copies (~150-500 MB/s, stack.md §4) while numpy arrays are read back zero-copy
(``make bench-numpy-torch``). Arrays that ``ray.get`` returns are read-only views of the object store, which torch
cannot wrap safely, so :func:`unpack` copies every read-only array (and a writable one only when asked to).
Model states travel as numpy (:func:`pack_state`): they leave a host once a round.

What a host reads back from a device for its records (losses, norms, counters) it reads once a round
(:func:`read_floats`), never per step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


def pack(t: torch.Tensor) -> np.ndarray:
    """Tensor -> numpy for the object store (detached, on CPU, contiguous): one staging copy from a device."""
    return t.detach().cpu().contiguous().numpy()


def stage(a):
    """What a message field becomes when it leaves the process: a tensor as numpy (:func:`pack`), a 0-d tensor as a
    float, anything else as it is."""
    if isinstance(a, torch.Tensor):
        return float(a) if a.dim() == 0 else pack(a)
    return a


def unpack(a, device: torch.device | str = "cpu", writable: bool = False) -> torch.Tensor:
    """A message's array or tensor as a tensor on ``device``: a tensor handed over in process as it is (moved only if
    it is on another device); numpy read-only arrays (from ``ray.get``) copied, writable ones shared unless
    ``writable``."""
    if isinstance(a, torch.Tensor):
        return a.detach().to(device)
    if writable or not a.flags.writeable:
        a = np.array(a, copy=True)
    return torch.from_numpy(a).to(device)


def labels(y, device) -> torch.Tensor:
    """A message's labels as an int64 tensor on ``device`` (a tensor handed over as it is; numpy copied)."""
    if isinstance(y, torch.Tensor):
        return y.to(device)
    return torch.as_tensor(np.array(y), device=device)


def nbytes(a) -> int:
    """The bytes of a message's array or tensor (from its shape: nothing is read)."""
    if isinstance(a, torch.Tensor):
        return a.element_size() * a.nelement()
    return int(np.asarray(a).nbytes)


def dtype_name(a) -> str:
    """The element type of an array or a tensor by numpy's name (``float32``)."""
    return str(a.dtype).removeprefix("torch.") if isinstance(a, torch.Tensor) else np.dtype(a.dtype).name


def read_floats(values: list) -> list[float]:
    """Floats of a list of 0-d tensors and floats, in one read (one synchronisation where the tensors are on an
    accelerator), each the exact value it holds: what a host reports once a round."""
    at = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    out = [v if isinstance(v, torch.Tensor) else float(v) for v in values]
    if at:
        dev = values[at[0]].device
        got = torch.stack([values[i].detach().reshape(()).to(dev, torch.float64) for i in at]).tolist()
        for i, v in zip(at, got):
            out[i] = v
    return out


def pack_state(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: pack(v) for k, v in state.items()}


def unpack_state(state: dict[str, np.ndarray], device="cpu") -> dict[str, torch.Tensor]:
    return {k: unpack(v, device) for k, v in state.items()}


def state_nbytes(state: dict) -> int:
    return int(sum(nbytes(v) for v in state.values()))


# ---- Ray Direct Transport (runtime.transport.kind: rdt) ---------------------------------------------------------
@dataclasses.dataclass
class RdtMessage:
    """An activation or a gradient on its way by Ray Direct Transport: its class and its fields, the features or
    the gradient as a CPU tensor (what gloo moves; Ray finds tensors in what a method returns), the rest (labels,
    the loss as a float) through the object store. Not a message itself, so nothing stages its tensors to numpy
    when Ray pickles it."""

    cls: type
    fields: dict


def to_tensors(msg):
    """An activation or gradient message as an :class:`RdtMessage` (its tensor on the CPU, staged once: an array
    shares its memory, a read-only one is copied first); anything else unchanged."""
    from raysplit.runtime.messages import Activation, Gradient  # the messages stage their fields with this module

    def t(a):
        if isinstance(a, torch.Tensor):
            return a.detach().cpu().contiguous()
        return torch.from_numpy(a if a.flags.writeable else a.copy())

    if isinstance(msg, Activation):
        fields = {**vars(msg), "x": t(msg.x), "y": np.asarray(msg.y)}
    elif isinstance(msg, Gradient) and msg.g is not None:
        fields = {**vars(msg), "g": t(msg.g)}
    else:
        return msg
    if "loss" in fields:
        fields["loss"] = stage(fields["loss"])
    return RdtMessage(type(msg), fields)


def from_tensors(msg):
    """:func:`to_tensors` undone on arrival: the message again, holding the received tensor (which this process
    owns) as a message handed over in process does."""
    return msg.cls(**msg.fields) if isinstance(msg, RdtMessage) else msg
