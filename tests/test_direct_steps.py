"""The actor-driven split-step path (``runtime.transport.direct_steps``, the default) computes exactly what the
driver-chained path computes: same weights bit for bit, same simulated clocks, same per-step losses."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch
from helpers import assert_identical_runs, load_script, make_config, run_rounds

from raysplit.runtime import ClientHost


# Variants the golden runs' defaults do not take (tests/test_golden.py's settings): steps of different clients
# interleaved, and Hydra's reversed cyclic order with phi; each checked on the three Ray paths against the local
# backend (the rest of what the driver-chained, actor-driven and compiled paths must agree on is every algorithm's
# golden run below). GAS's event loop has no driver-chained form: its two transports.
VARIANTS = {"sflv2-random": ({"name": "sflv2", "order": "random"}, ("chained", "calls", "compiled")),
            "hydra-cyclic_reverse-2": ({"name": "hydra", "order": "cyclic_reverse", "phi": 2},
                                       ("chained", "calls", "compiled")),
            "gas": ({"name": "gas"}, ("calls", "compiled"))}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_interleaved_variants_compute_the_same_bits_on_every_path(ray_session, tmp_path, mlflow_uri, variant):
    """In process, driver-chained (``runtime.transport.direct_steps: false``), actor-driven over actor calls and over
    compiled graphs: same weights bit for bit, same simulated clocks, same per-step losses. (Issue 51: this one test
    replaces three that ran the same pairs separately: direct against chained on six algorithms, compiled against
    calls on three, local against Ray on one; the algorithms they held in the golden runs' settings are each in the
    path check below.)"""
    algorithm, paths = VARIANTS[variant]
    over = {"algorithm": algorithm, "train.rounds": 2, "train.local_steps": 3, "data.num_clients": 5,
            "train.optimizer.momentum": 0.9}
    want = run_rounds(make_config(tmp_path, mlflow_uri, **over, **{"runtime.backend": "local"}))
    for path in paths:
        assert_identical_runs(want, run_rounds(make_config(tmp_path, mlflow_uri, **over, **PATHS[path])))


class RefusingClient(ClientHost):
    """Raises the host's own exception at client 1's second forward, inside a server-driven sequence."""

    CALLS = {**ClientHost.CALLS, "forward": "forward"}  # its own forward, not the steps component's

    def forward(self, tag, batch_size=None):
        if tag.client == 1 and tag.step == 1:
            raise LookupError(f"client {tag.client} refuses step {tag.step}")
        return self.steps.forward(tag, batch_size)


@pytest.mark.parametrize("transport", ["compiled", "calls"])
def test_client_actor_error_in_driven_steps_surfaces_as_itself(ray_session, tmp_path, mlflow_uri, transport):
    """An exception raised by a client host inside a server-driven sequence reaches the driver as the host's own
    exception type (not a wrapped RayTaskError), over compiled graphs and actor calls alike."""
    import ray.cloudpickle

    from raysplit.experiment import prepare
    from raysplit.runtime import Runtime, make_backend

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's host travels to the actors
    cfg = make_config(tmp_path, mlflow_uri, **{"train.local_steps": 2, "runtime.transport.kind": transport})
    p = prepare(cfg)
    rt = Runtime(make_backend(cfg.runtime), dataclasses.replace(p.inputs, client_host=RefusingClient))
    try:
        rt.begin_round(0, [0, 1], 0.0)
        rt.split_steps([0, 0, 1, 1])
        with pytest.raises(LookupError, match="client 1 refuses step 1"):
            rt.end_round()
    finally:
        rt.shutdown()


def test_server_aggregate_handles_zero_dim_buffers(tmp_path, mlflow_uri):
    """FedAvg of client parts with BatchNorm (resnet18 cut after layer1): num_batches_tracked is a 0-d int64."""
    from raysplit.experiment import prepare
    from raysplit.runtime import ServerHost, StateMsg, transport

    cfg = make_config(tmp_path, mlflow_uri, **{
        "model.name": "resnet18", "model.cut": "stem", "data.dataset": "synthetic", "runtime.backend": "local",
        "data.options": {"num_samples": 64, "shape": [3, 32, 32]}})
    p = prepare(cfg)
    i = p.inputs
    host = ServerHost(i.plan, i.server_init, i.client_init, i.test_data)
    a = {k: np.array(v, copy=True) for k, v in i.client_init.items()}
    b = {k: np.array(v, copy=True) for k, v in i.client_init.items()}
    nbt = next(k for k in a if k.endswith("num_batches_tracked"))
    a[nbt], b[nbt] = np.array(2, np.int64), np.array(4, np.int64)
    out = host.aggregate(StateMsg(a, weight=1.0), StateMsg(b, weight=1.0))
    st = transport.unpack_state(out.state)
    assert st[nbt].dtype == torch.int64 and int(st[nbt]) == 3  # (2*1 + 4*1) / 2


@pytest.mark.parametrize("algorithm", [
    {"name": "sflv2", "order": "random"},  # split steps, clients interleaved
    {"name": "psl"},  # split steps on per-client copies
    {"name": "splitnn"},  # one client's split steps after another's, the client model handed on
    {"name": "cyclesglr"},  # pooled steps
    {"name": "s2fl"},  # pooled steps over groups with server copies
], ids=lambda a: "-".join(map(str, a.values())))
def test_the_driver_chained_port_runs_the_same_loops_bit_for_bit(tmp_path, mlflow_uri, monkeypatch, algorithm):
    """One loop per kind of step (runtime/stepping.py): run where the server lives (``LocalPort``) or from the
    driver with every call a handle (``DriverPort``, what ``runtime.transport.direct_steps: false`` uses), the clients get
    the same calls in the same order: same weights bit for bit, clocks, losses and steps."""
    from raysplit.runtime import LocalBackend

    over = {"algorithm": algorithm, "train.rounds": 2, "train.local_steps": 3, "data.num_clients": 5,
            "train.optimizer.momentum": 0.9, "runtime.backend": "local"}
    direct = run_rounds(make_config(tmp_path, mlflow_uri, **over))
    monkeypatch.setattr(LocalBackend, "direct_steps", False)
    assert_identical_runs(direct, run_rounds(make_config(tmp_path, mlflow_uri, **over)))


def _synchronous_algorithms() -> list[str]:
    from raysplit.algorithms import ALGORITHMS, AsyncAlgorithm

    # splitlora needs a language model and centralised communicates nothing: their Ray runs equal their local ones
    # in tests/test_lm_methods.py
    return sorted(n for n, a in ALGORITHMS.items() if not issubclass(a, AsyncAlgorithm)
                  and n not in ("splitlora", "centralised"))


# the four ways a round's steps can travel: in process, the driver chaining every call, the server actor driving the
# client actors with actor calls, and over compiled graphs (two client actors each, so that clients move between them)
PATHS = {
    "local": {"runtime.backend": "local"},
    "chained": {"runtime.backend": "ray", "runtime.transport.direct_steps": False, "runtime.transport.kind": "calls"},
    "calls": {"runtime.backend": "ray", "runtime.transport.direct_steps": True, "runtime.transport.kind": "calls"},
    "compiled": {"runtime.backend": "ray", "runtime.transport.direct_steps": True, "runtime.transport.kind": "compiled"},
    # the Ray Direct Transport prototype (issue 29): driver-chained, activations and gradients over gloo
    "rdt": {"runtime.backend": "ray", "runtime.transport.direct_steps": False, "runtime.transport.kind": "rdt"},
}


golden = load_script("golden")


def _final_state(name: str, path: str) -> tuple[dict, list[dict]]:
    """``name``'s golden run on ``path``: every tensor, array and number of the runtime's final checkpoint (weights,
    optimizer states, clocks, cursors, per client) by its place in the checkpoint, and the per-round metrics."""
    leaves: dict = {}

    def walk(o, at):
        if isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{at}.{k}")
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f"{at}[{i}]")
        elif at.endswith("torch_rng"):
            return  # the process's global generator: shared by every host in process, one per actor under Ray
        elif isinstance(o, (torch.Tensor, np.ndarray, int, float, bool)) or o is None:
            leaves[at] = o
        elif dataclasses.is_dataclass(o):
            walk(dataclasses.asdict(o), at)

    def keep(rnd, file, run_id):
        walk(torch.load(file, weights_only=False)["runtime"], "runtime")

    extra = {**PATHS[path], "runtime.num_workers": 2, "runtime.server.num_cpus": 0.5, "runtime.client.num_cpus": 0.5,
             "runtime.keep_actors_s": 30}
    rounds = golden.run(name, on_checkpoint=keep, **extra)["rounds"]
    assert leaves, f"{name} on {path}: no final checkpoint"
    return leaves, rounds


# Which Ray path each algorithm's golden run takes in CI (the full tier): one each, eight per path, so that split
# steps and pooled steps go through every path at least twice, and Semi-SFL's two streams a client step (student and
# teacher: semisfl, fedswitch_sl) through the driver-chained and the compiled path (through actor calls:
# tests/test_architecture.py's two-stream test). `make path-matrix` (``--matrix``) runs every algorithm on every path,
# as CI did before issue 51; run it after a change to a transport or to how a loop is driven.
CI_PATH = {
    "chained": ["splitnn", "sflv1", "hydra", "fedavg", "sflv1_scaffold", "cyclesglr", "sglr", "fedswitch_sl"],
    "calls": ["psl", "sflv3", "multihead", "splitgp", "minibatch_sfl", "cyclepsl", "supervised_only", "semifl"],
    "compiled": ["sflv2", "sflv1_prox", "pipar", "s2fl", "cyclesfl", "semisfl", "ampere", "mergesfl"],
}


def _path_params():
    ci = {(name, path) for path, names in CI_PATH.items() for name in names}
    for name in _synchronous_algorithms():
        for path in ("chained", "calls", "compiled"):
            yield pytest.param(name, path, marks=[] if (name, path) in ci else [pytest.mark.matrix],
                               id=f"{name}-{path}")


def test_every_synchronous_algorithm_takes_one_path_in_ci():
    """CI_PATH names every round-based algorithm once, and only those (a new method is given a path here)."""
    named = [n for names in CI_PATH.values() for n in names]
    assert sorted(named) == _synchronous_algorithms(), sorted(set(named) ^ set(_synchronous_algorithms()))


_local: dict = {}


@pytest.mark.parametrize("name,path", list(_path_params()))
def test_every_synchronous_algorithm_computes_the_same_bits_on_all_four_paths(ray_session, name, path):
    """Issue 27: every round-based algorithm, run in process (local), through Ray with the driver chaining every call
    (chained), with the server actor driving the client actors by actor calls (calls) and over compiled graphs
    (compiled), ends with the same final checkpoint bit for bit (every weight, optimizer state, clock and cursor of
    server and clients; not the hosts' copies of the process-global torch generator, which in process is one for
    all hosts: a method that drew from it would show in the metrics) and logs the same per-round metrics exactly (losses, accuracy, bytes, FLOPs, simulated
    time): the paths are transports of one computation, not four implementations. CI runs each algorithm on the
    path ``CI_PATH`` gives it (issue 51); ``--matrix`` runs every pair."""
    if name not in _local:
        _local[name] = _final_state(name, "local")
    _assert_same_run(name, path, _local[name], _final_state(name, path))


def _assert_same_run(name: str, path: str, want: tuple, got: tuple) -> None:
    """:func:`_final_state` of ``name`` on ``path`` equals ``want`` (the local backend's) bit for bit."""
    (want_state, want_rounds), (state, rounds) = want, got
    assert sorted(state) == sorted(want_state), f"{name} on {path}: the checkpoint holds other entries"
    for at, a in want_state.items():
        b = state[at]
        same = (torch.equal(a, b) if isinstance(a, torch.Tensor) else
                np.array_equal(a, b, equal_nan=a.dtype.kind == "f") if isinstance(a, np.ndarray) else
                a == b or (isinstance(a, float) and a != a and b != b))
        assert same, f"{name} on {path}: {at} differs from the local backend's ({a!r} vs {b!r})"[:400]
    for r_want, r_got in zip(want_rounds, rounds, strict=True):
        diff = {k: (v, r_got.get(k)) for k, v in r_want.items() if not (v == r_got.get(k) or v != v)}
        assert not diff and set(r_got) == set(r_want), f"{name} on {path}, round {r_want['round']}: {diff}"


# one stream per client step; two (student, teacher); pooled steps (the server's call_split takes RDT activations)
@pytest.mark.parametrize("name", ["sflv2", "semisfl", "cyclesglr"])
def test_rdt_transport_computes_the_same_bits(ray_session, name):
    """Issue 29 item 5, the Ray Direct Transport prototype (``runtime.transport.kind: rdt``, driver-chained): the
    clients' activations and the server's gradients travel over a gloo group as tensors, and the run ends with the
    local backend's final checkpoint and metrics bit for bit."""
    _assert_same_run(name, "rdt", _final_state(name, "local"), _final_state(name, "rdt"))


def test_rdt_hop_is_a_direct_transport_object_the_receiver_reads_as_arrays(ray_session):
    """What ``RdtHostActor.call_rdt`` returns is an RDT object, not an object-store copy (a plain ``ray.get`` of a
    two-sided gloo object is refused), and the actor that takes it as an argument gets the message back holding the
    received tensor (its own: handed over as in process, never copied to an array) and the labels as an array, with
    the sent values."""
    import ray
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    from raysplit.runtime.messages import Activation, Tag
    from raysplit.runtime.ray.actors import RdtHostActor

    class Host:  # defined here, so that Ray ships it by value to the actors
        @property
        def calls(self):
            return {"forward": self.forward, "total": self.total}

        def forward(self, n):
            return Activation(Tag(3, 0, 0), np.arange(n, dtype=np.float32), np.arange(n) % 10, 1.5)

        def total(self, act):
            return type(act.x).__name__, type(act.y).__name__, float(act.x.sum()), int(act.y.sum()), act.tag

    a, b = (RdtHostActor.options(num_cpus=0).remote(Host) for _ in range(2))
    group = create_collective_group([a, b], backend="torch_gloo")
    try:
        ref = a.call_rdt.remote("forward", 1000)
        with pytest.raises(ValueError, match="two-sided"):
            ray.get(ref, timeout=60)
        assert ray.get(b.call.remote("total", ref), timeout=60) == ("Tensor", "ndarray", 499500.0, 4500,
                                                                    Tag(3, 0, 0))
    finally:
        destroy_collective_group(group)
        for h in (a, b):
            ray.kill(h)


@pytest.mark.parametrize("cores,workers,kind", [(2, 2, "compiled-steps"), (3, 2, "compiled-steps"),
                                                (4, 2, "compiled"), (16, 8, "compiled"), (16, 15, "compiled-steps")])
def test_auto_transport_keeps_polling_actors_off_the_event_loop_where_cores_are_few(cores, workers, kind):
    """``runtime.transport.kind: auto``: compiled graphs for every loop where each actor and the driver has a core
    of its own (idle compiled-graph actors poll their channels); with fewer cores, compiled graphs only for the
    step loops (the actors compute in turn) and actor calls for the event loop (they compute at once)."""
    from raysplit.config import load_config
    from raysplit.runtime.ray.backend import RayBackend
    from raysplit.runtime.ray.resources import auto_transport

    got, why = auto_transport(cores, workers)
    assert got == kind and f"{cores:g} CPU cores" in why and str(workers) in why
    backend = RayBackend(load_config(None, {"runtime.transport.kind": "auto"}).runtime)
    backend.transport = got
    assert backend.compiled_for("steps") and backend.compiled_for("pooled")
    assert backend.compiled_for("events") == (kind == "compiled")
    for fixed in ("compiled", "calls"):  # a named transport is used for every loop
        backend.transport = fixed
        assert all(backend.compiled_for(loop) == (fixed == "compiled") for loop in ("steps", "pooled", "events"))


def test_auto_transport_is_resolved_at_connect_and_logged(ray_session, tmp_path, mlflow_uri, monkeypatch):
    """The default transport is ``auto``: the backend resolves it when it connects, from the cores it finds, uses
    the result for the driven loops, and the run logs it as the param ``resolved.transport``."""
    from mlflow.tracking import MlflowClient

    from raysplit.config import TransportConfig
    from raysplit.experiment import run_experiment
    from raysplit.runtime import make_backend
    from raysplit.runtime.ray import backend as ray_backend

    assert TransportConfig().kind == "auto"
    cfg = make_config(tmp_path, mlflow_uri, **{"runtime.transport.kind": "auto", "train.rounds": 1})
    for cores, kind in ((2.0, "compiled-steps"), (64.0, "compiled")):
        monkeypatch.setattr(ray_backend, "usable_cores", lambda rcfg, c=cores: c)
        backend = make_backend(cfg.runtime)
        backend.connect()
        assert backend.transport == kind and backend.resolved()["transport"] == kind
    chained = make_backend(make_config(tmp_path, mlflow_uri, **{"runtime.transport.kind": "auto",
                                                                "runtime.transport.direct_steps": False}).runtime)
    chained.connect()  # no driven loop to carry: the driver chains every call, whatever the cores
    assert chained.transport == "calls" and "direct_steps" in chained.transport_reason
    monkeypatch.setattr(ray_backend, "usable_cores", lambda rcfg: 2.0)  # the 2-core machine
    final = run_experiment(cfg)
    params = MlflowClient(mlflow_uri).get_run(final["run_id"]).data.params
    assert params["runtime.transport.kind"] == "auto"
    assert params["resolved.transport"] == "compiled-steps"
    assert "2 CPU cores for 4 processes" in params["resolved.transport_reason"]
    # where the hosts computed, as each actor resolved runtime.<role>.device (issue 53): no GPU here
    assert params["resolved.server_device"] == "cpu" and params["resolved.client_device"] == "cpu"
    from raysplit.runtime.devices import cpu_kind

    assert params["resolved.cpu"] == cpu_kind() and torch.backends.cpu.get_cpu_capability() in cpu_kind()
    local = run_experiment(make_config(tmp_path, mlflow_uri, **{"runtime.backend": "local", "train.rounds": 1}))
    lp = MlflowClient(mlflow_uri).get_run(local["run_id"]).data.params
    assert lp["resolved.transport"] == "in-process" and lp["resolved.client_device"] == "cpu"
    assert lp["resolved.cpu"] == params["resolved.cpu"]


def test_auto_threads_follow_the_machine_or_the_actors_cpu_share():
    """``runtime.torch_threads: auto`` on a private Ray: where the loop runs over compiled graphs (idle actors poll)
    or is the event loop (actors compute at once) each actor gets its share of the cores, at least one; a step loop
    over actor calls (idle actors block) the machine's cores;
    joining a cluster, its CPU share rounded up. The default is one thread in every host (the same metrics on any
    backend, transport and number of actors); a number is used as given, null leaves torch's own default."""
    from raysplit.config import load_config
    from raysplit.runtime.ray.backend import RayBackend
    from raysplit.runtime.ray.resources import auto_threads

    assert load_config(None, {}).runtime.torch_threads == 1
    rcfg = load_config(None, {"runtime.num_workers": 2, "runtime.torch_threads": "auto"}).runtime
    assert auto_threads(rcfg, 2.0, polling=True)[0] == {"server": 1, "client": 1}  # the 2-core machine
    assert auto_threads(rcfg, 16.0, polling=True)[0] == {"server": 5, "client": 5}  # 16 // (2 clients + server)
    threads, why = auto_threads(rcfg, 2.0, polling=False)
    assert threads == {"server": 2, "client": 2} and "2 cores" in why and "block" in why
    threads, why = auto_threads(rcfg, 2.0, polling=False, concurrent=True)  # the event loop over actor calls
    assert threads == {"server": 1, "client": 1} and "at once" in why
    assert auto_threads(rcfg, 16.0, polling=False, concurrent=True)[0] == {"server": 5, "client": 5}
    joined = load_config(None, {"runtime.address": "auto", "runtime.server.num_cpus": 3,
                                "runtime.client.num_cpus": 0.5}).runtime
    for polling in (True, False):
        threads, why = auto_threads(joined, 64.0, polling)
        assert threads == {"server": 3, "client": 1} and "CPU share" in why
    fixed = RayBackend(load_config(None, {"runtime.torch_threads": 3}).runtime)
    assert fixed.resolved()["torch_threads"] == 3 and fixed.threads_reason == "runtime.torch_threads"
    assert RayBackend(load_config(None, {"runtime.torch_threads": None}).runtime).resolved()["torch_threads"] is None
    with pytest.raises(Exception, match="torch_threads"):
        load_config(None, {"runtime.torch_threads": 0})


def test_limit_threads_gives_torch_its_threads_and_blas_one():
    """A host's ``limit_threads(n)`` leaves torch's OpenMP pool at ``n`` threads and the BLAS pools at one. It
    once limited every pool (threadpoolctl's default), which set torch's OpenMP pool back to one thread, so a
    ``runtime.torch_threads`` of 2 or ``auto`` ran torch on one thread. In a fresh interpreter: the limits are
    process-wide."""
    import subprocess

    code = ("import torch, threadpoolctl\nfrom raysplit.runtime.devices import limit_threads\n"
            "torch.get_num_threads()\nlimit_threads(2)\n"
            "pools = {i['user_api']: i['num_threads'] for i in threadpoolctl.threadpool_info()}\n"
            "print(torch.get_num_threads(), pools.get('openmp'), pools.get('blas'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    torch_n, openmp, blas = out.stdout.split()
    assert torch_n == "2" and openmp in ("2", "None") and blas in ("1", "None"), out.stdout


def test_auto_threads_reach_the_hosts_and_are_logged(ray_session, tmp_path, mlflow_uri, monkeypatch):
    """With ``auto`` the run logs the resolved thread count as ``resolved.torch_threads``, from the loop's transport: a
    split-step method over compiled graphs gets a share per actor, over actor calls the machine's cores. The
    local backend gives its one process the machine's cores, and its hosts set them."""
    import torch
    from mlflow.tracking import MlflowClient

    from raysplit.experiment import run_experiment
    from raysplit.runtime.driver import api, local
    from raysplit.runtime.ray import backend as ray_backend

    def params(**over):
        final = run_experiment(make_config(tmp_path, mlflow_uri, **{"train.rounds": 1, "runtime.torch_threads": "auto",
                                                                    **over}))
        return MlflowClient(mlflow_uri).get_run(final["run_id"]).data.params

    monkeypatch.setattr(ray_backend, "usable_cores", lambda rcfg: 6.0)
    got = params(**{"runtime.num_workers": 2, "runtime.transport.kind": "auto"})  # compiled: 6 // 3 per actor
    assert got["runtime.torch_threads"] == "auto" and got["resolved.transport"] == "compiled"
    assert got["resolved.torch_threads"] == "2" and "poll" in got["resolved.torch_threads_reason"]
    got = params(**{"runtime.num_workers": 2, "runtime.transport.kind": "calls"})
    assert got["resolved.torch_threads"] == "6" and "block" in got["resolved.torch_threads_reason"]
    before = torch.get_num_threads()
    for module in (api, local):  # the logged count and the local hosts' own
        monkeypatch.setattr(module, "machine_cores", lambda: 1)
    try:
        local = run_experiment(make_config(tmp_path, mlflow_uri, **{"runtime.backend": "local", "train.rounds": 1,
                                                                    "runtime.torch_threads": "auto"}))
        assert torch.get_num_threads() == 1  # the in-process hosts set it
    finally:
        torch.set_num_threads(before)
    assert MlflowClient(mlflow_uri).get_run(local["run_id"]).data.params["resolved.torch_threads"] == "1"
