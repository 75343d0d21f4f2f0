"""What the hosts' state is made of and how it crosses into a host: a model with its optimizer (:class:`ModelSlot`),
the attributes a checkpoint carries (:class:`Checkpointed`), state a host owns (:func:`owned`) and every backend's
way into a host (:func:`invoke`, through its table of calls)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ModelSlot:
    """A module with its optimizer: a client being trained this round, the server model, a copy or a head."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer


class Checkpointed:
    """A host's or an algorithm's own attributes that checkpoints carry: each class names its own in
    ``checkpointed`` (gathered over the class hierarchy), and the base ``state_dict``/``load_state_dict`` carry
    them, so a subclass that keeps state across rounds writes no pair of its own. A module or an optimizer is
    carried as its ``state_dict`` and loaded into the object in place (what else holds it keeps holding it); any
    other value is replaced."""

    checkpointed: tuple[str, ...] = ()

    def own_state(self) -> dict:
        values = {k: getattr(self, k) for k in self.checkpointed_names()}
        return {k: v.state_dict() if hasattr(v, "load_state_dict") else v for k, v in values.items()}

    def load_own_state(self, saved: dict) -> None:
        names = self.checkpointed_names()
        missing = [k for k in names if k not in saved]
        if missing:
            raise ValueError(f"{type(self).__name__}: the checkpoint holds no {missing} (written by an older "
                             f"raysplit?)")
        for k in names:
            current = getattr(self, k, None)
            if hasattr(current, "load_state_dict"):
                current.load_state_dict(saved[k])
            else:
                setattr(self, k, saved[k])

    @classmethod
    def checkpointed_names(cls) -> list[str]:
        return [n for c in reversed(cls.__mro__) for n in vars(c).get("checkpointed", ())]


# host methods that take state over (a snapshot, a checkpoint, clients moving in): what they are given is copied first
RESTORES = frozenset({"load_state_dict", "import_clients"})


def to_host(value: Any) -> Any:
    """``value`` with every tensor in its containers (dicts, lists, tuples) on the CPU: what leaves a host for
    another process (a snapshot for the keeper, which holds no GPU; a checkpoint; clients moving to another actor).
    Objects with their own pickling (messages) stage their tensors themselves."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return value
        # a meta tensor has no data to copy: its shape and dtype on the CPU
        return torch.empty_like(value, device="cpu") if value.is_meta else value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_host(v) for v in value)
    return value


def to_device(value: Any, device) -> Any:
    """:func:`to_host` undone: every tensor in ``value``'s containers on ``device`` (a restored rule's state)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_device(v, device) for v in value)
    return value


def owned(value: Any) -> Any:
    """``value`` as state a host owns: containers rebuilt, every numpy array a writable copy, every tensor a clone.
    State that reaches a host through Ray's object store is deserialized zero-copy, so its numpy arrays are read-only
    views of shared memory; in process it is the very object the caller keeps (a :class:`RoundGuard` snapshot that
    may be restored again). A host that updated either in place would fail ("output array is read-only") or change
    the snapshot under its keeper."""
    return copy.deepcopy(value)


def invoke(host: Any, method: str, *args, **kwargs) -> Any:
    """Every backend's way into a host: ``serve`` (the server's entry, which screens what arrives) or a name in the
    host's table of calls (``host.calls``: its own and its rule's; anything else is refused, naming the host), with
    the arguments of a restoring call (:data:`RESTORES`, also when it is reached through ``serve``) made
    :func:`owned` first."""
    if method in RESTORES or (method == "serve" and args and args[0] in RESTORES):
        args, kwargs = owned(args), owned(kwargs)
    if method == "serve":
        return host.serve(*args, **kwargs)
    try:
        fn = host.calls[method]
    except KeyError:
        raise AttributeError(f"{type(host).__name__} accepts no call {method!r} (its calls: "
                             f"{', '.join(sorted(host.calls))})") from None
    return fn(*args, **kwargs)
