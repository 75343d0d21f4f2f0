"""A client host's clients moving to another host, and its checkpoint."""

from __future__ import annotations

import copy
import zlib

import torch

from raysplit.runtime.client.states import clone_state
from raysplit.runtime.client.meter import Counters
from raysplit.runtime.devices import device_rng_state, set_device_rng_state
from raysplit.runtime.spill import StoreView
from raysplit.runtime.state import to_host


class Moves:
    """Clients moving between hosts (placement), the host's state for a checkpoint or a snapshot (a component of the
    client host). A client's state is every per-client mapping its ``owners`` (the host's components and its rule)
    name in their ``client_fields``; ``changed``: the host's set of clients changed since the last snapshot."""

    def __init__(self, owners, steps, slots, data, states, executor, cut, rule, changed: set[int],
                 worker_index: int):
        self.owners, self.steps, self.slots, self.data, self.states = owners, steps, slots, data, states
        self.executor, self.cut, self.rule_of, self.changed = executor, cut, rule, changed
        self.worker_index = worker_index

    @property
    def rule(self):
        return self.rule_of()

    def _books(self) -> dict[str, object]:
        """Each per-client mapping's name and the object that holds it."""
        return {name: owner for owner in (*self.owners(), self.rule) for name in owner.client_fields}

    def _fields_of(self, cid: int, take: bool) -> dict:
        """Client ``cid``'s entry of every per-client mapping that has one (removed from here if ``take``)."""
        out = {}
        for name, owner in self._books().items():
            book = getattr(owner, name)
            if cid in book:
                value = book.pop(cid) if take else book.peek(cid) if isinstance(book, StoreView) else book[cid]
                out[name] = dict(value.v) if isinstance(value, Counters) else value
        if take:
            self.data.forget(cid)
            self.changed.discard(cid)
        return out

    def export_clients(self, cids: list[int]) -> dict[int, dict]:
        """Hand clients ``cids`` over to another host (the runtime placed them there): their state leaves this
        host. Only between rounds: a client with a slot (trained now) cannot move."""
        busy = [int(c) for c in cids if int(c) in self.states.slots]
        if busy:
            raise RuntimeError(f"worker {self.worker_index}: clients {busy[:5]} are being trained; they cannot move")
        return to_host({int(c): self._fields_of(int(c), take=True) for c in cids if int(c) in self.data})

    def import_clients(self, *bundles: dict[int, dict]) -> None:
        """Take clients over from other hosts (``export_clients``' results)."""
        books = self._books()
        for bundle in bundles:
            for c, fields in bundle.items():
                for name, value in fields.items():
                    if name == "totals":
                        books[name].totals[c] = Counters()
                        books[name].totals[c].add(**value)
                    else:
                        getattr(books[name], name)[c] = value
                self.changed.add(int(c))

    def changed_clients(self) -> list[int]:
        """Clients whose state may have changed since the last call (they took part in a round or job, received a
        model, or arrived here); the incremental snapshots of ``RoundGuard`` copy only these."""
        out = sorted(self.changed)
        self.changed.clear()
        return out

    # ---- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self, clients: list[int] | None = None) -> dict:
        """Everything that persists across rounds: the host's own state and every held client's (``clients``: of
        those only, for an incremental snapshot; ``held`` always lists them all). Synchronous rounds end with no
        slot; under the event driver, active clients' slots (weights, optimizer) and their forwards awaiting a
        gradient are kept as what it takes to redo them (batch indices, the module's buffers before the
        forward)."""
        pending, replay = self.steps.pending, self.steps.replay
        if pending and set(pending) != set(replay):
            raise RuntimeError(f"worker {self.worker_index}: checkpoint with activations awaiting a gradient "
                               f"({sorted(pending)[:5]}) outside the event driver")
        slots = {c: (clone_state(sl.module), copy.deepcopy(sl.optimizer.state_dict()))
                 for c, sl in self.states.slots.items()}
        held = sorted(self.data.train_idx)
        which = held if clients is None else [int(c) for c in clients if int(c) in self.data]
        return to_host({"global": self.states.global_state, "held": held,
                        "clients": {c: self._fields_of(c, take=False) for c in which},
                        "torch_rng": torch.get_rng_state(), "device_rng": device_rng_state(self.executor.device),
                        "slots": slots, "replay": dict(replay), "dropped": dict(self.slots.dropped),
                        "own": self.rule.own_state()})

    def load_state_dict(self, st: dict) -> None:
        """Restore :meth:`state_dict`'s result (with every held client's state)."""
        if set(st["clients"]) != set(st["held"]):
            raise ValueError(f"worker {self.worker_index}: state of clients {sorted(st['clients'])[:5]}... does "
                             f"not match the held clients {st['held'][:5]}...")
        self.states.global_state = st["global"]
        self.executor.deferred.clear()
        for name, owner in self._books().items():
            getattr(owner, name).clear()
        self.data.forget()
        self.import_clients(st["clients"])
        self.slots.dropped.clear()  # the same mapping the host's components hold
        self.slots.dropped.update(st.get("dropped", {}))
        self.rule.load_own_state(st.get("own", {}))
        for c, (weights, opt) in st.get("slots", {}).items():
            self.states.restore_slot(c, weights, opt)
        for tag, (idx, buffers) in sorted(st.get("replay", {}).items()):  # rebuild the graphs, charging nothing
            module = self.states.slots[tag.client].module
            after = {k: b.detach().clone() for k, b in module.named_buffers()}
            module.load_state_dict(buffers, strict=False)
            x, _ = self.data.batch(idx)
            with self.executor.seeded(tag.client, 0, tag.round, tag.step, zlib.crc32(tag.stream.encode())):
                self.steps.pending[tag] = module(x)
            if self.cut.defence is not None:  # the same release (its noise stream is seeded per step), not counted
                self.steps.pending[tag] = self.steps.defend(tag, x, self.steps.pending[tag], count=False)[0]
            module.load_state_dict(after, strict=False)
            self.steps.replay[tag] = (idx, buffers)
        torch.set_rng_state(st["torch_rng"])
        set_device_rng_state(self.executor.device, st.get("device_rng"))
        self.changed.clear()
