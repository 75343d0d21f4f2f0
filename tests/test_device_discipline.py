"""Device discipline on a machine without CUDA (issue 70): PyTorch's ``meta`` device stands in for the accelerator
where only shapes matter. Hosts built on it must hold their models and their rules' tensors there (none left on
the CPU by mistake, none made on the CPU where the host computes on another device); what leaves a host (snapshots,
checkpoints, clients moving) is on the CPU; the event loop's cost model counts on a CPU copy; a device's failure
(out of memory) surfaces instead of silently turning packing off; deterministic kernels are set per run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import make_config, load_script
from raysplit.experiment import prepare
from raysplit.runtime import ClientHost, ServerHost
from raysplit.runtime.driver.api import host_inputs

golden = load_script("golden")
META = torch.device("meta")


def tensors_of(obj, seen=None, depth=0):
    """Every tensor an object holds in its attributes, containers and modules (parameters, buffers), with a path."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield "", obj
    elif isinstance(obj, torch.nn.Module):
        for n, t in [*obj.named_parameters(), *obj.named_buffers()]:
            yield "." + n, t
    elif isinstance(obj, dict):
        for k, v in obj.items():
            for p, t in tensors_of(v, seen, depth + 1):
                yield f"[{k!r}]" + p, t
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            for p, t in tensors_of(v, seen, depth + 1):
                yield f"[{i}]" + p, t
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("raysplit."):
        for k, v in vars(obj).items():
            for p, t in tensors_of(v, seen, depth + 1):
                yield "." + k + p, t


# what a host keeps in host memory by design: the client-state store (loaded into a device module when a client is
# activated), the initial states as messages, the Semi-SFL feature queue (moved to the device where it is used), the
# event loop's cost model (it counts on a CPU copy)
HOST_MEMORY = ("states.", "client_init", "initial_client", ".queue.", "global_state", "costs.part")


def hosts_on(device, monkeypatch, tmp_path, name):
    """The golden configuration's server and first client host of ``name``, built on ``device``."""
    import raysplit.runtime.client.host as ch
    import raysplit.runtime.server.host as sh
    from helpers import write_fake_fashion_mnist
    from raysplit.config import load_config

    monkeypatch.setattr(sh, "host_device", lambda want, key: device)
    monkeypatch.setattr(ch, "host_device", lambda want, key: device)
    over = golden.overrides(name)
    if over.get("data.root") == golden.FAKE_FMNIST:
        write_fake_fashion_mnist(tmp_path / "data")
        over["data.root"] = str(tmp_path / "data")
    cfg = load_config(None, {**over, "tracking.enabled": False})
    i = prepare(cfg).inputs
    server = i.server_host(i.plan, i.server_init, i.client_init, i.test_data, i.labeled_data)
    tr, te, pr = host_inputs(i, 1)[0]
    client = i.client_host(i.plan, 0, i.train_data, tr, te, pr, i.client_init)
    return server, client


METHODS = ["sflv2", "psl", "hydra", "semisfl", "gas", "ampere", "splitgp", "sflv1_scaffold", "cyclesfl", "fedbuff"]


@pytest.mark.parametrize("name", METHODS)
def test_every_tensor_a_host_holds_after_setup_is_on_its_device(name, monkeypatch, tmp_path):
    server, client = hosts_on(META, monkeypatch, tmp_path, name)
    for host in (server, client):
        held = list(tensors_of(host))
        off = [f"{type(host).__name__}{p} on {t.device}" for p, t in held
               if t.device != META and not any(h in p for h in HOST_MEMORY)]
        assert not off, off
        assert any(t.device == META for _, t in held)  # the walk sees the host's models


@pytest.mark.parametrize("name", ["sflv2", "hydra", "semisfl", "gas", "sflv1_scaffold"])
def test_snapshots_checkpoints_and_moving_clients_leave_a_host_on_the_cpu(name, monkeypatch, tmp_path):
    """The keeper of snapshots holds no GPU and a checkpoint must load anywhere: a host's state leaves on the CPU,
    with its device's random state beside torch's."""
    server, client = hosts_on(META, monkeypatch, tmp_path, name)
    st = server.state_dict()
    assert "device_rng" in st
    for what, state in (("server", st), ("client", client.moves.state_dict()),
                        ("moving", client.moves.export_clients([0]))):
        off = [p for p, t in tensors_of(state) if t.device.type != "cpu"]
        assert not off, (what, off)


def test_the_event_loops_cost_model_counts_on_a_cpu_copy():
    """GAS's server moves its client part to its device; the cost model counts FLOPs on a copy on the CPU (the
    same counts), not on the server's device with CPU zeros."""
    from raysplit.runtime.server.events import ClientCosts, EventPlan
    from raysplit.clock import ClientProfile

    torch.manual_seed(0)
    part = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten())
    plan = EventPlan(active=1, local_steps=1, client_sizes=(10,), profiles=(ClientProfile(1e9, 1e6, 1e6),))
    cpu = ClientCosts(part, plan, 4, (1, 8, 8), 100, True)
    meta = ClientCosts(part.to_empty(device=META), plan, 4, (1, 8, 8), 100, True)
    assert meta.act_shape == cpu.act_shape == (4 * 6 * 6,)
    assert [meta.flops(k, 4) for k in ("fwd", "bwd", "train")] == [cpu.flops(k, 4) for k in ("fwd", "bwd", "train")]
    assert all(p.device.type == "cpu" for p in meta.part.parameters())


def test_a_device_failure_surfaces_instead_of_turning_packing_off(monkeypatch, tmp_path):
    """Only vmap's refusal of a model makes batched copies (and packed clients) fall back; CUDA out of memory, a
    driver or cuDNN error is raised."""
    from raysplit.runtime import batched

    assert batched.vmap_refused(RuntimeError("vmap: called random operation while in randomness error mode"))
    assert not batched.vmap_refused(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not batched.vmap_refused(RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"))
    cfg = make_config(tmp_path, None, **{"runtime.backend": "local", "algorithm.name": "psl",
                                         "algorithm.batched_copies": True})
    i = prepare(cfg).inputs
    host = ServerHost(i.plan, i.server_init, i.client_init, i.test_data)

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(batched, "copies_backward", oom)
    from raysplit.runtime.messages import Activation, Tag

    host.begin_round(0, 0.0)
    host.models.fork([0, 1])
    shape, dtype = host.screen.form()
    acts = [Activation(Tag(c, 0, 0), np.zeros((4, *shape), dtype), np.zeros(4, np.int64), 0.0) for c in (0, 1)]
    with pytest.raises(torch.cuda.OutOfMemoryError):
        host.serve("train_copies", *acts)
    assert host.models.unbatched is None  # not remembered as a refusal: the next step tries again


def test_deterministic_kernels_are_set_per_run_and_put_back(tmp_path):
    from raysplit.experiment import run_experiment

    before = torch.are_deterministic_algorithms_enabled()
    assert not before
    run_experiment(make_config(tmp_path, None, **{"runtime.backend": "local", "runtime.deterministic": True,
                                                  "train.rounds": 1, "tracking.enabled": False}))
    assert torch.are_deterministic_algorithms_enabled() is before  # the run's setting did not outlive it


def test_a_devices_random_state_is_saved_and_restored(monkeypatch):
    """A GPU's generator (dropout on the server) is saved and set back (faked here: no CUDA on this machine)."""
    from raysplit.runtime import devices

    got = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.tensor([7, 7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: got.update(state=state, device=device))
    cuda = torch.device("cuda", 0)
    state = devices.device_rng_state(cuda)
    assert state.tolist() == [7, 7] and devices.device_rng_state(torch.device("cpu")) is None
    devices.set_device_rng_state(cuda, state)
    assert got["device"] == cuda and got["state"].tolist() == [7, 7]
