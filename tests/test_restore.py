"""Restored state is owned: whatever a host takes over (a snapshot after an actor died, a checkpoint, clients moving
in) is writable and its own, for every host state of every algorithm.

State that reaches an actor through Ray's object store arrives zero-copy: its numpy arrays are read-only views of
shared memory. The test reproduces that in process (pickle protocol 5 with read-only out-of-band buffers, Ray's own
mechanism), restores every host from such a copy at a round boundary, checks that no array or tensor the hosts hold
is read-only or lies in the snapshot's memory, and lets the run go on: its metrics must still be the golden ones."""

from __future__ import annotations

import pickle
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import capture_runtimes
from raysplit.runtime.state import Checkpointed, invoke, owned

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import golden  # noqa: E402


def ray_like_copy(value):
    """``value`` as an actor receives it from Ray's object store: pickled with out-of-band buffers that are read
    back read-only. Returns the copy and the memory those buffers occupy (address, size)."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    views = [memoryview(bytearray(b.raw())).toreadonly() for b in buffers]
    spans = [(np.frombuffer(v, np.uint8).ctypes.data, v.nbytes) for v in views if v.nbytes]
    return pickle.loads(data, buffers=views), spans


def foreign(obj, spans, path="host", seen=None, out=None) -> list[str]:
    """Where in ``obj`` an array or tensor is read-only or lies in ``spans`` (the snapshot's memory)."""
    seen = set() if seen is None else seen
    out = [] if out is None else out
    if id(obj) in seen or len(out) > 10:
        return out
    seen.add(id(obj))

    def inside(ptr, n):
        return n > 0 and any(a <= ptr < a + size for a, size in spans)

    if isinstance(obj, np.ndarray):
        if obj.dtype != object:
            if not obj.flags.writeable:
                out.append(f"{path}: read-only array {obj.shape}")
            elif inside(obj.ctypes.data, obj.nbytes):
                out.append(f"{path}: array in the snapshot's memory")
            return out
        for i, v in enumerate(obj.flat):
            foreign(v, spans, f"{path}[{i}]", seen, out)
    elif isinstance(obj, torch.Tensor):
        if inside(obj.data_ptr(), obj.nbytes):
            out.append(f"{path}: tensor in the snapshot's memory")
    elif isinstance(obj, torch.nn.Module):
        for k, v in obj.state_dict(keep_vars=True).items():
            foreign(v, spans, f"{path}.{k}", seen, out)
    elif isinstance(obj, torch.optim.Optimizer):
        foreign(obj.state_dict(), spans, f"{path}.state_dict()", seen, out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            foreign(v, spans, f"{path}[{k!r}]", seen, out)
    elif isinstance(obj, (list, tuple, set, frozenset, deque)):
        for i, v in enumerate(obj):
            foreign(v, spans, f"{path}[{i}]", seen, out)
    elif type(obj).__module__.startswith("raysplit") and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            foreign(v, spans, f"{path}.{k}", seen, out)
    return out


class _Stop(Exception):
    pass


def _params():
    """Every algorithm; in the fast tier one per pair of host classes (the state types), the others in the full."""
    from raysplit.algorithms import ALGORITHMS

    seen = set()
    for name in [n for n in golden.algorithms() if n not in golden.PLUGINS]:  # (client rule, server host): the methods
        pair = (ALGORITHMS[name].client_rule, ALGORITHMS[name].server_rule)
        yield pytest.param(name, marks=[pytest.mark.slow] if pair in seen else [])
        seen.add(pair)


@pytest.mark.parametrize("name", list(_params()))
def test_every_host_owns_the_state_it_restores_and_the_run_goes_on_as_before(monkeypatch, name):
    made = capture_runtimes(monkeypatch)
    want = golden.load(name)["rounds"]
    last = len(want) - 1 if name == "ampere" else 1  # Ampere: both phases; the others: one round after a restore
    got, problems = [], []

    def restore(rnd, metrics):
        got.append(metrics)
        if rnd == last:
            raise _Stop
        rt = made[-1]
        snapshot, spans = ray_like_copy(rt.state_dict())
        rt.load_state_dict(snapshot)
        b = rt.backend
        problems.extend(foreign(b.server, spans, "server") +
                        [p for i, w in enumerate(b.workers) for p in foreign(w, spans, f"worker{i}")])

    with pytest.raises(_Stop):
        golden.run(name, on_round=restore)
    assert problems == [], f"{name}: restored state not owned: {problems}"
    have = [{"round": r, **{k: float(v) for k, v in sorted(m.items()) if k not in golden.WALL_CLOCK}}
            for r, m in enumerate(got)]
    assert golden.differences({"algorithm": name, "rounds": want[:last + 1]}, {"rounds": have}) == []


def test_a_host_taking_state_over_gets_a_writable_copy_of_its_own():
    """The mechanism on its own: ``invoke`` copies what a restoring method is given, and only then."""
    arr, _ = ray_like_copy({"stats": np.zeros(3)})
    assert not arr["stats"].flags.writeable  # what Ray hands an actor

    class Host:
        def __init__(self):
            self.calls = {"load_state_dict": self.load_state_dict, "peek": self.peek}

        def load_state_dict(self, st):
            self.st = st
            st["stats"] += 1  # an in-place update, as GAS's Gaussians do

        def serve(self, method, *args):
            return self.calls[method](*args)

        def peek(self, st):
            return st

    h = Host()
    invoke(h, "load_state_dict", arr)
    assert h.st["stats"].tolist() == [1, 1, 1] and arr["stats"].tolist() == [0, 0, 0]
    invoke(h, "serve", "load_state_dict", arr)  # a server method arrives through ServerHost.serve
    assert h.st["stats"].tolist() == [1, 1, 1]
    assert invoke(h, "peek", arr) is arr  # not a restore: no copy on the step path
    with pytest.raises(ValueError, match="read-only"):
        h.load_state_dict(arr)  # without invoke: the failure of the issue
    t = torch.ones(2)
    assert owned({"t": t})["t"].data_ptr() != t.data_ptr()


class _Keeps(Checkpointed):
    checkpointed = ("count", "net")

    def __init__(self, seed: int):
        self.count, self.net = seed, torch.nn.Linear(2, 2)
        torch.nn.init.constant_(self.net.weight, float(seed))


class _KeepsMore(_Keeps):
    checkpointed = ("extra",)

    def __init__(self, seed: int):
        super().__init__(seed)
        self.extra = [seed]


def test_checkpointed_attributes_gather_over_the_classes_load_modules_in_place_and_name_what_is_missing():
    """A host or algorithm names the attributes a checkpoint carries; a subclass adds its own to its parents'; a
    module is loaded into the object that others hold; a checkpoint without one of them is refused by name."""
    from raysplit.algorithms.asyncfl import CA2FLServer

    assert CA2FLServer.checkpointed_names() == ["uploads", "start_of", "pending", "cache"]  # beside the host's own
    saved = pickle.loads(pickle.dumps(_KeepsMore(3).own_state()))
    fresh = _KeepsMore(0)
    net = fresh.net
    fresh.load_own_state(saved)
    assert fresh.net is net and torch.equal(net.weight, torch.full((2, 2), 3.0))
    assert (fresh.count, fresh.extra) == (3, [3])
    with pytest.raises(ValueError, match=r"_KeepsMore: the checkpoint holds no \['extra'\]"):
        _KeepsMore(0).load_own_state({"count": 1, "net": saved["net"]})


def test_a_checkpoint_naming_a_class_by_its_place_before_the_runtimes_rooms_still_loads(tmp_path, monkeypatch):
    """Checkpoints written before raysplit/runtime/ had folders (issue 69) name the event loop's classes as
    ``raysplit.runtime.events.*`` (and its plan as ``EventSetup``): they load into the classes where they live now
    (checked by hand on 932ba23's checkpoints of eight methods: each resumed to its golden round 2); a name that was
    never raysplit's is still refused."""
    import dataclasses
    import sys
    import types

    from raysplit.experiment import MOVED_CLASSES, load_checkpoint_file
    from raysplit.runtime.server.events import EventPlan, Job

    old = types.ModuleType("raysplit.runtime.events")  # the module as it was, for pickle to write its names
    old.EventSetup = dataclasses.make_dataclass("EventSetup", [(f.name, f.type) for f in dataclasses.fields(EventPlan)],
                                                frozen=True)
    old.Job = dataclasses.make_dataclass("Job", [(f.name, f.type) for f in dataclasses.fields(Job)])
    for cls in (old.EventSetup, old.Job):
        cls.__module__ = "raysplit.runtime.events"
    monkeypatch.setitem(sys.modules, "raysplit.runtime.events", old)
    torch.save({"events": old.EventSetup(2, 3, (4, 5), (), True), "job": old.Job(1, 0, 0, 0.0, 0)},
               tmp_path / "old.ckpt")
    names = torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "old.ckpt")
    assert {"raysplit.runtime.events.EventSetup", "raysplit.runtime.events.Job"} <= set(names) <= set(MOVED_CLASSES)
    monkeypatch.undo()
    got = load_checkpoint_file(tmp_path / "old.ckpt")
    assert type(got["events"]) is EventPlan and got["events"].client_sizes == (4, 5) and got["events"].active == 2
    assert type(got["job"]) is Job and got["job"].client == 1
