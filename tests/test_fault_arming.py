"""``runtime.faults.inject_fault`` arms on every family's hosts (fast tier: the fault matrix itself, which kills
actors, is the full tier's). The injector fuses the public methods of a host, its rule and its components; a frozen
part of a host (its plan) is data and takes no fuse. That went unseen in the fast tier once: every fault-matrix case
failed in the actors' constructors while every fast test passed."""

from __future__ import annotations

import inspect

import pytest

from helpers import load_script, write_fake_fashion_mnist
from raysplit.config import load_config
from raysplit.experiment import prepare
from raysplit.runtime import runtime_for
from raysplit.runtime.ray.actors import arm_fault, fault_targets

golden = load_script("golden")


@pytest.mark.parametrize("name", ["sflv2", "psl", "cyclesfl", "hydra", "gas", "semisfl", "ampere"])
def test_the_fault_injector_arms_every_part_of_every_familys_hosts(tmp_path, name):
    over = golden.overrides(name)  # the golden configuration of each family of the fault matrix
    if over.get("data.root") == golden.FAKE_FMNIST:
        write_fake_fashion_mnist(tmp_path / "data")
        over["data.root"] = str(tmp_path / "data")
    cfg = load_config(None, {**over, "runtime.backend": "local", "tracking.enabled": False})
    rt = runtime_for(cfg.runtime, prepare(cfg).inputs)
    try:
        for host in [rt.backend.server, *rt.backend.workers]:
            parts = fault_targets(host)
            arm_fault(host, rnd=10**6, call=1)  # armed far in the future: nothing is killed here
            callable_parts = [p for p in parts if any(not n.startswith("_") and inspect.isfunction(getattr(type(p), n))
                                                      for n in dir(type(p)))]
            unfused = [p for p in callable_parts if not any(hasattr(v, "__wrapped__") for v in vars(p).values())]
            assert len(callable_parts) >= 4 and not unfused, (type(host).__name__, unfused)
            assert hasattr(vars(host)["end_round"], "__wrapped__")
    finally:
        rt.shutdown()
