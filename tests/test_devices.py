"""Where hosts compute (issue 53): ``runtime.server.device`` / ``runtime.client.device``, the determinism switch,
GPU shares under Ray. This machine has no GPU: the CUDA paths are checked where a CPU can check them (the data
path's device branch on CPU tensors, errors naming their keys, Ray's logical GPUs), and on a GPU machine by
``make bench-gpu``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import golden  # noqa: E402

from raysplit.config import load_config  # noqa: E402
from raysplit.data import DataSpec, to_tensor  # noqa: E402
from raysplit.errors import ConfigError  # noqa: E402
from raysplit.runtime import make_backend
from raysplit.runtime.client.data import ClientData
from raysplit.runtime.devices import host_device, set_determinism

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = not torch.cuda.is_available()


def _cfg(**over):
    return load_config(None, {"data.dataset": "digits", "model.name": "cnn_small", **over})


def test_runtime_device_is_now_the_server_actors_and_the_old_key_moves_with_a_warning():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = _cfg(**{"runtime.device": "cpu"})
    assert cfg.runtime.server.device == "cpu" and cfg.runtime.client.device == "auto"
    assert any("runtime.server.device" in str(x.message) for x in w), [str(x.message) for x in w]
    from raysplit.config import validate

    with pytest.raises(Exception, match="runtime.device and runtime.server.device are the same setting"):
        validate({"data": {"dataset": "digits"}, "runtime": {"device": "cpu", "server": {"device": "cpu"}}})


@pytest.mark.parametrize("role", ["server", "client"])
def test_cuda_under_ray_without_a_gpu_share_is_one_error_naming_both_keys(role):
    with pytest.raises(Exception) as e:
        _cfg(**{f"runtime.{role}.device": "cuda"})
    assert f"runtime.{role}.device=cuda" in str(e.value) and f"runtime.{role}.num_gpus" in str(e.value)
    cfg = _cfg(**{f"runtime.{role}.device": "cuda", f"runtime.{role}.num_gpus": 0.25})  # a share is enough
    assert getattr(cfg.runtime, role).num_gpus == 0.25


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("role", ["server", "client"])
def test_cuda_in_process_on_a_machine_without_one_is_refused_before_any_host(role):
    cfg = _cfg(**{"runtime.backend": "local", f"runtime.{role}.device": "cuda"})
    with pytest.raises(ConfigError, match=rf"^runtime\.{role}\.device=cuda: this process sees no CUDA device"):
        make_backend(cfg.runtime)
    assert host_device("auto", "k") == torch.device("cpu") == host_device("cpu", "k")


def test_determinism_is_left_alone_on_the_cpu_unless_asked_for():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert set_determinism("auto", torch.device("cpu")) is False
        assert not torch.are_deterministic_algorithms_enabled()
        assert set_determinism(False, torch.device("cuda")) is False
        assert set_determinism("auto", torch.device("cuda")) is True  # the flags only: no CUDA call is made
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(before)
        torch.backends.cudnn.deterministic = False


def test_a_tensor_of_stored_values_converts_as_the_array_does():
    x = np.random.default_rng(0).integers(0, 256, (5, 1, 8, 8), dtype=np.uint8)
    for spec in (DataSpec("t", "image", (1, 8, 8), 10, mean=(0.3,), std=(0.2,)), DataSpec("t", "image", (1, 8, 8), 10),
                 DataSpec("t", "float", (1, 8, 8), 10)):
        assert torch.equal(to_tensor(torch.from_numpy(x), spec), to_tensor(x, spec))


def test_the_device_branch_of_the_data_cuts_the_same_batches():
    """A host on a GPU keeps the samples there once and cuts each batch there; the branch, run on CPU tensors,
    gives the batches the array path gives."""
    rng = np.random.default_rng(1)
    data = {"x": rng.integers(0, 256, (40, 1, 8, 8), dtype=np.uint8), "y": rng.integers(0, 10, 40)}
    spec = DataSpec("t", "image", (1, 8, 8), 10, mean=(0.5,), std=(0.25,))
    kw = dict(batch_size=6, seed=3, drop_last=False, changed=set())
    plain = ClientData(data, {0: np.arange(20)}, {0: np.arange(20, 25)}, spec, **kw)
    staged = ClientData(data, {0: np.arange(20)}, {0: np.arange(20, 25)}, spec, **kw)
    staged._on_device = (torch.from_numpy(data["x"].copy()), torch.as_tensor(data["y"], dtype=torch.long))
    for _ in range(5):
        (xa, ya), (xb, yb) = plain.batch(plain.draw(0)), staged.batch(staged.draw(0))
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and yb.dtype == torch.long


def test_hosts_on_an_explicit_cpu_device_reproduce_the_fingerprint():
    """``runtime.server.device`` / ``client.device`` / ``deterministic`` given explicitly: sflv2's golden run
    unchanged (the CPU path is the one every result was computed with)."""
    got = golden.run("sflv2", **{"runtime.server.device": "cpu", "runtime.client.device": "cpu",
                                 "runtime.deterministic": True})
    assert not golden.differences(golden.load("sflv2"), got)


GPU_SHARES = textwrap.dedent("""
    import sys, ray
    from pathlib import Path
    sys.path.insert(0, "tests")
    from helpers import make_config
    from raysplit.experiment import run_experiment
    from raysplit.errors import ResourceError
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    over = {"runtime.address": "auto", "runtime.num_workers": 2, "runtime.client.num_gpus": 0.5,
            "runtime.client.num_cpus": 0.25, "runtime.server.num_cpus": 0.25, "runtime.keep_actors_s": 0,
            "train.rounds": 1, "tracking.enabled": False}
    tmp = Path(sys.argv[1])
    out = run_experiment(make_config(tmp, f"sqlite:///{tmp}/m.db", **over))
    print("ran", out["eval/accuracy"] > 0)
    try:
        run_experiment(make_config(tmp, f"sqlite:///{tmp}/m.db", **{**over, "runtime.client.num_gpus": 0.75}))
    except ResourceError as e:
        print("refused", e)
""")


@pytest.mark.subprocess
def test_client_actors_share_ray_gpus_and_a_share_no_cluster_has_is_refused(tmp_path):
    """Two client actors on one of Ray's logical GPUs (0.5 each: two to a GPU) run; 0.75 each (1.5 GPUs) is one
    ResourceError naming the GPUs, before any actor starts. With no CUDA here, ``device: auto`` computes on the CPU."""
    r = subprocess.run([sys.executable, "-c", GPU_SHARES, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**__import__("os").environ, "RAY_AUTH_MODE": "disabled"})
    out = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0 and "ran True" in r.stdout, out
    assert "refused" in r.stdout and "GPU: need 1.5 (server 0 + 2 client actors x 0.75), cluster has 1" in r.stdout, out


# ---- packed clients (issue 53 item 3) -------------------------------------------------------------------------------

def _close(expected: dict, got: dict, rel: float) -> list[str]:
    """The metrics of two runs' rounds that differ by more than ``rel`` (wall-clock ones aside)."""
    out = []
    for want, have in zip(expected["rounds"], got["rounds"]):
        for k, a in want.items():
            b = have.get(k)
            if b is not None and a != a and b != b:  # NaN in both (no gradient norms in FedAvg's rounds)
                continue
            if not (b is not None and abs(a - b) <= rel * max(1.0, abs(a))):
                out.append(f"{k} at round {want['round']}: {a!r} against {b!r}")
    return out


def _packed_steps(name, **extra) -> tuple[dict, int]:
    """``name``'s golden run with ``extra``, and how many client steps its hosts ran packed."""
    from raysplit import experiment

    made = []
    build = experiment.runtime_for

    def keep(*a, **k):
        rt = build(*a, **k)
        made.append(list(rt.backend.workers))  # the hosts (the backend forgets them at shutdown)
        return rt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experiment, "runtime_for", keep)
        got = golden.run(name, **extra)
    return got, sum(w.executor.packed_steps for w in made[-1])


@pytest.mark.parametrize("name, extra", [
    ("fedavg", {}), ("ampere", {}),  # local training, the device phase
    ("cyclesfl", {}), ("cyclepsl", {}), ("cyclesglr", {}), ("minibatch_sfl", {}),  # pooled split steps
    ("mergesfl", {}),  # pooled split steps of per-client batch sizes: padded
    ("semisfl", {}), ("fedswitch_sl", {}),  # two streams a client: the students packed, the teacher one at a time
    ("psl", {"algorithm.batched_copies": True}),  # pooled split steps into batched server copies
])
def test_packed_clients_train_as_one_at_a_time_within_float_rounding(name, extra):
    """FedAvg's local training, Ampere's device phase and the pooled split steps (CycleSL, MiniBatch-SFL,
    MergeSFL, Semi-SFL's student streams, PSL's interleaved batched copies: a host's clients forward as one vmapped
    computation and take their gradients back through it in one backward) with ``runtime.pack_clients`` on: the clients' steps ran batched
    (counted), and every metric of every round equals the golden run's (one client after another) within 1e-6;
    off (auto on a CPU), the golden run bit for bit (tests/test_golden.py). MergeSFL's clients take batches of
    their own sizes (regulated by speed): cnn_small mixes no samples, so they pack padded to the largest."""
    got, packed = _packed_steps(name, **{"runtime.pack_clients": True, **extra})
    want = golden.load(name) if not extra else _packed_steps(name, **{"runtime.pack_clients": False, **extra})[0]
    assert packed > 0
    off = _close(want, got, 1e-6)  # 5e-8 seen
    if name == "cyclesglr":  # SGLR's gradient is the mean over every sample of the active clients: at round 0
        # (random weights) the samples' gradients mostly cancel, so the mean's norm carries their rounding about
        # 1,000-fold (1.2e-4 seen; 1e-7 from round 1, and every loss and accuracy within 1e-7)
        loose = _close(want, got, 1e-3)
        off = [d for d in off if not d.startswith("train/grad_norm_") or d in loose]
    assert not off, off[:8]


@pytest.mark.parametrize("name", ["psl", "sflv1", "sflv3", "multihead"])
def test_per_client_copies_interleave_their_steps_when_clients_pack(name):
    """PSL, SFLV1, SFLV3 (per-client server copies) and MultiHead (per-client server heads) serve one client's steps
    after another; with ``runtime.pack_clients`` on they interleave them (Runtime.packs_clients), so that a host's
    clients forward and take their gradients back packed while the server steps each copy in turn: the clients'
    steps ran packed, every metric but the clock equals the golden run's (one client after another) within 1e-6, and
    the clock is the interleaved one (that of the unpacked interleaved run, batched copies, within 1e-6, where the
    method has them). Packing off (auto on a CPU), the golden run is bit for bit (tests/test_golden.py)."""
    got, packed = _packed_steps(name, **{"runtime.pack_clients": True})
    assert packed > 0
    want = golden.load(name)
    assert got["rounds"][-1]["time/sim"] != want["rounds"][-1]["time/sim"]  # not the in-turn clock
    off = [d for d in _close(want, got, 1e-6) if not d.startswith("time/")]
    assert not off, off[:8]
    if name != "multihead":
        want, unpacked = _packed_steps(name, **{"runtime.pack_clients": False, "algorithm.batched_copies": True})
        assert unpacked == 0 and not _close(want, got, 1e-6)


def test_a_rule_that_cannot_pack_keeps_its_clients_in_turn():
    """SplitGP inherits SFLV1's copies but its client rule changes the backward (ClientRule.packable is false): with
    packing on its steps are not interleaved for nothing; the run is its golden run, clock included, and nothing
    packed."""
    from raysplit.algorithms.sflvariants import SplitGPRule

    assert not SplitGPRule.packable()
    got, packed = _packed_steps("splitgp", **{"runtime.pack_clients": True})
    assert packed == 0 and not golden.differences(golden.load("splitgp"), got)


@pytest.mark.parametrize("name", ["fedavg", "sflv1", "mergesfl"])
def test_packed_runs_on_one_or_two_client_hosts_agree_within_float_rounding(name):
    """Packing changes which clients share a computation with the number of client hosts (local training; split
    steps, interleaved or pooled, padded): the guarantee across actor counts becomes equality within float rounding
    (bit for bit only with packing off)."""
    one, p1 = _packed_steps(name, **{"runtime.pack_clients": True, "runtime.num_workers": 1})
    two, p2 = _packed_steps(name, **{"runtime.pack_clients": True, "runtime.num_workers": 2})
    assert p1 > 0 and p2 > 0 and not _close(one, two, 1e-6)


def test_a_model_vmap_refuses_trains_one_client_after_another():
    """Dropout draws per client from its own stream one at a time; batched, vmap refuses it (randomness='error'):
    the executor says so once and the caller trains the clients alone."""
    from raysplit.runtime.client.executor import Executor

    ex = Executor(seed=0, pack=True)
    torch.manual_seed(0)
    mods = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)) for _ in range(2)]
    xs, ys = [torch.randn(5, 4) for _ in mods], [torch.randint(0, 3, (5,)) for _ in mods]
    assert ex.train_together(("t",), mods, xs, ys) is None and "random" in ex.unpackable.lower()
    assert all(p.grad is None for m in mods for p in m.parameters()) and ex.packed_steps == 0
    plain = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)) for _ in range(2)]
    fresh = Executor(seed=0, pack=True)
    out = fresh.train_together(("t",), plain, xs, ys)
    assert out is not None and fresh.packed_steps == 2 and all(p.grad is not None for p in plain[1].parameters())
    want = torch.nn.functional.cross_entropy(plain[1](xs[1]), ys[1]).item()
    assert out[1][0] == pytest.approx(want, rel=1e-6) and out[1][1] > 0
    assert Executor(0, pack="auto").pack is False and Executor(0, torch.device("cuda"), "auto").pack is True


def test_packed_forwards_take_their_gradients_back_as_one_at_a_time():
    """Executor.forward_together: three clients' conv/BatchNorm parts forward as one vmapped computation; each
    activation, each BatchNorm's running statistics and, after the gradients come back in two calls (the graph kept
    for the one still waiting), each module's gradients equal the client's own forward and backward within float
    rounding; the FLOPs are those the unpacked path counts. A model vmap refuses (dropout) is refused once."""
    import copy

    from raysplit.runtime.client.executor import Backward, Executor, Forward

    torch.manual_seed(0)

    def part():
        return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                   torch.nn.Flatten())

    mods = [part() for _ in range(3)]
    ref = [copy.deepcopy(m) for m in mods]
    xs = [torch.randn(5, 1, 6, 6) for _ in mods]
    gs = [torch.randn(5, 64) for _ in mods]
    plain = Executor(seed=0)
    want = [plain.forward([Forward(("fwd", (5, 1, 6, 6)), m, x)])[0] for m, x in zip(ref, xs)]
    ex = Executor(seed=0, pack=True)
    done, pack = ex.forward_together(mods, xs)
    for (out, fl), (w, wfl) in zip(done, want):
        assert torch.allclose(out, w, atol=1e-6) and fl == wfl > 0
    for m, r in zip(mods, ref):
        assert torch.allclose(m[1].running_mean, r[1].running_mean, atol=1e-7) and int(m[1].num_batches_tracked) == 1
    wbf = [plain.backward([Backward(("bwd", (5, 64)), w, g)])[0] for (w, _), g in zip(want, gs)]
    pack.backward([(0, gs[0]), (2, gs[2])])  # client 1's gradient comes later: the graph is kept for it
    pack.backward([(1, gs[1])])
    assert pack.backward_flops == wbf and wbf[0] > 0 and ex.packed_steps == 3
    for m, r in zip(mods, ref):
        for p, q in zip(m.parameters(), r.parameters()):
            assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-5)
    drop = [torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.5)) for _ in range(2)]
    assert ex.forward_together(drop, xs[:2]) is None and "random" in ex.unpackable.lower()


def test_ragged_batches_pack_padded_where_no_layer_mixes_samples():
    """Batches of 3, 7 and 5 samples (MergeSFL's per-client sizes) through a conv part without BatchNorm: padded
    to 7 and packed, each client's activation has its own rows and equals its own forward, its parameters' gradients
    equal its own backward (the padded rows contribute nothing), and its forward and backward FLOPs are those of its
    own batch. A part with BatchNorm in training mode is not ragged_ok (the padding would enter its statistics)."""
    import copy

    from raysplit.runtime.client.executor import Backward, Executor, Forward, ragged_ok

    torch.manual_seed(1)
    mods = [torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten()) for _ in range(3)]
    ref = [copy.deepcopy(m) for m in mods]
    xs = [torch.randn(n, 1, 6, 6) for n in (3, 7, 5)]
    gs = [torch.randn(len(x), 64) for x in xs]
    assert ragged_ok(mods[0])
    bn = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    assert not ragged_ok(bn) and ragged_ok(bn.eval())
    plain = Executor(seed=0)
    want = [plain.forward([Forward(("fwd", tuple(x.shape)), m, x)])[0] for m, x in zip(ref, xs)]
    wbf = [plain.backward([Backward(("bwd", tuple(w.shape)), w, g)])[0] for (w, _), g in zip(want, gs)]
    ex = Executor(seed=0, pack=True)
    done, pack = ex.forward_together(mods, xs)
    for (out, fl), (w, wfl) in zip(done, want):
        assert out.shape == w.shape and torch.allclose(out, w, atol=1e-6) and fl == wfl > 0
    assert len({fl for _, fl in done}) == 3 and pack.backward_flops == wbf and len(set(wbf)) == 3
    pack.backward(list(enumerate(gs)))
    for m, r in zip(mods, ref):
        for p, q in zip(m.parameters(), r.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-5)


def test_a_rejected_gradient_in_a_packed_step_drops_that_client_as_unpacked(monkeypatch):
    """A NaN gradient for one client of a packed pooled step (CycleSFL, runtime.faults.on_bad_client: drop): that
    client is dropped for the round and charged the backward it stood for, the rest of its pack steps; every
    metric equals the unpacked run's with the same fault within 1e-6, and differs from the run without it."""
    import numpy as np

    from raysplit.runtime.messages import Gradient
    from raysplit.runtime.server.host import ServerHost

    serve = ServerHost.serve

    def faulty(self, method, *args, **kwargs):
        out = serve(self, method, *args, **kwargs)
        if isinstance(out, (list, tuple)) and out and isinstance(out[0], Gradient) and out[0].tag.round == 0 \
                and out[0].tag.step == 1:
            out = list(out)
            out[0] = Gradient(out[0].tag, np.full_like(out[0].g, np.nan), out[0].t_sent, out[0].loss)
        return out

    monkeypatch.setattr(ServerHost, "serve", faulty)
    extra = {"runtime.faults.on_bad_client": "drop"}
    packed, n = _packed_steps("cyclesfl", **{"runtime.pack_clients": True, **extra})
    unpacked, n0 = _packed_steps("cyclesfl", **{"runtime.pack_clients": False, **extra})
    assert n > 0 and n0 == 0
    assert not _close(unpacked, packed, 1e-6), _close(unpacked, packed, 1e-6)[:8]
    assert _close(golden.load("cyclesfl"), packed, 1e-6)  # the fault changed the run
