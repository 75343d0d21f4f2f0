"""The client host's components, each on its own (raysplit/runtime/client_data.py, meter.py, client_states.py,
cut.py, executor.py): what each promises the host, checked without a host around it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raysplit.clock import ClientProfile, FlopCache
from raysplit.config import OptimizerConfig
from raysplit.data import DataSpec
from raysplit.privacy import NoiseDefence, NopeekDefence, PrivacySpec
from raysplit.runtime.client.data import ClientData, advance_cursor
from raysplit.runtime.client.states import ClientStates
from raysplit.runtime.client.cut import ClientCut
from raysplit.runtime.client.executor import Backward, Executor, Forward
from raysplit.runtime.messages import Tag
from raysplit.runtime.client.meter import CostMeter

SPEC = DataSpec("toy", "float", (3,), 2)


def _data(changed, drop_last=False, n=10):
    x = np.arange(3 * 2 * n, dtype=np.float32).reshape(2 * n, 3)
    y = np.arange(2 * n) % 2
    return ClientData({"x": x, "y": y}, {0: np.arange(n), 1: np.arange(n, 2 * n)}, {0: np.arange(2), 1: []}, SPEC,
                      batch_size=4, seed=3, drop_last=drop_last, changed=changed)


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_data_cursor_walks_a_seeded_permutation_per_client_and_epoch(drop_last):
    changed: set[int] = set()
    data = _data(changed, drop_last)
    epoch0 = [data.draw(0) for _ in range(2 if drop_last else 3)]
    assert [len(b) for b in epoch0] == ([4, 4] if drop_last else [4, 4, 2])  # 10 samples, batches of 4
    assert changed == {0}
    want = np.random.default_rng([3, 0, 0]).permutation(np.arange(10))
    assert np.array_equal(np.concatenate(epoch0), want[:8] if drop_last else want)
    first = data.draw(0)  # the next epoch: another permutation of the same client's samples
    assert np.array_equal(first, np.random.default_rng([3, 0, 1]).permutation(np.arange(10))[:4])
    assert data.cursor[0] == (1, 4) and data.cursor[1] == (0, 0)
    # the same rule the event loop predicts batch sizes with
    cur, sizes = (0, 0), []
    for _ in range(4):
        e, start, stop = advance_cursor(10, 4, cur, drop_last)
        cur = (e, stop)
        sizes.append(stop - start)
    assert sizes == [len(b) for b in epoch0] + [4] * (4 - len(epoch0))
    x, y = data.batch(first)
    assert x.dtype == torch.float32 and y.dtype == torch.long and np.array_equal(y.numpy(), first % 2)
    data.forget(0)  # a forgotten permutation is redrawn from the seed: the same batches
    assert np.array_equal(data.draw(0), np.random.default_rng([3, 0, 1]).permutation(np.arange(10))[4:8])


def test_the_cost_meter_charges_with_the_profiles_arithmetic_and_sums_rounds():
    changed: set[int] = set()
    prof = {0: ClientProfile(1e9, 1e6, 2e6), 1: ClientProfile(2e9, 1e6, 1e6)}
    meter = CostMeter(prof, [0, 1], charge_server=True, changed=changed)
    meter.start_round([0, np.int64(1)], 5.0)
    assert meter.charge_compute(0, 2e9) == 7.0
    assert meter.charge_upload(0, 3e6, "activations") == 10.0
    assert meter.charge_download(0, 2e6, t_sent=12.0, kind="gradients") == 13.0  # waits for the message, then 1 s
    assert meter.upload_seconds(0, 3e6) == 3.0 and meter.download_seconds(0, 2e6) == 1.0
    meter.count(0, steps=1)
    assert meter.counted(0, "steps") == 1 and meter.counted(1, "steps") == 0
    assert changed == {0, 1}
    rows = meter.close_round()
    row = rows[0]
    assert row["t_end"] == 13.0 and row["flops"] == 2e9 and row["bytes_up_activations"] == 3e6
    assert row["bytes_down_gradients"] == 2e6 and 1 not in rows  # client 1 charged nothing
    meter.start_round([0], 0.0)
    meter.charge_compute(0, 1e9)
    meter.close_round()
    totals = meter.client_totals()[0]
    assert totals["rounds"] == 2 and totals["flops"] == 3e9 and totals["t_last"] == 1.0
    free = CostMeter(prof, [0], charge_server=False, changed=set())  # GAS's code: downloads take no time
    assert free.charge_download(0, 2e6, t_sent=4.0, kind="model") == 4.0 and free.download_seconds(0, 2e6) == 0.0


def test_the_state_store_keeps_weights_and_optimizer_state_and_pools_modules():
    changed: set[int] = set()
    torch.manual_seed(0)
    built = []

    def build():
        built.append(torch.nn.Linear(3, 2))
        return built[-1]

    init = {k: v.clone() for k, v in torch.nn.Linear(3, 2).state_dict().items()}
    sgd = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9)
    states = ClientStates(build, init, sgd, persist=True, state_bytes=None, spill_dir=None, changed=changed)
    slot = states.activate(0, lr=0.5)
    assert slot.optimizer.param_groups[0]["lr"] == 0.5 and torch.equal(slot.module.weight, init["weight"])
    F.cross_entropy(slot.module(torch.ones(4, 3)), torch.zeros(4, dtype=torch.long)).backward()
    slot.optimizer.step()
    trained = {k: v.clone() for k, v in slot.module.state_dict().items()}
    states.release(0)
    assert torch.equal(states.own[0]["weight"], trained["weight"]) and "momentum_buffer" in str(states.opt_state[0])
    assert changed == {0}
    again = states.activate(1, lr=0.5)  # a pooled module, loaded with the global weights
    assert again.module is built[0] and len(built) == 1 and torch.equal(again.module.weight, init["weight"])
    again.module.weight.data.add_(1.0)
    states.release(1, keep_state=False)  # a dropped client keeps what it had before the round
    assert 1 not in states.own and 1 not in states.opt_state
    states.install({k: v + 1 for k, v in init.items()}, only=[1])
    assert torch.equal(states.state_of(1)["weight"], init["weight"] + 1)
    states.install(init)  # a new global model; with persist on, the clients' own models stay
    assert 0 in states.own and torch.equal(states.state_of(2)["weight"], init["weight"])


def test_the_cut_counts_noised_releases_and_keeps_nopeeks_inputs_until_the_gradient():
    noise = ClientCut(PrivacySpec(defence=NoiseDefence(kind="noise", sigma=1.0, clip=1.0)))
    assert noise.accounted
    z = torch.randn(4, 3, requires_grad=True)
    sent, _ = noise.release(Tag(0, 0, 0), torch.ones(4, 3), z, rate=0.25)
    noise.release(Tag(0, 0, 1), torch.ones(4, 3), z, rate=0.25)
    noise.release(Tag(0, 0, 2), torch.ones(4, 3), z, rate=None)  # rebuilt from a checkpoint: not counted
    assert noise.dp_releases == {0: {0.25: 2}} and noise.take_leak(Tag(0, 0, 0)) is None
    assert sent.shape == z.shape and not torch.equal(sent, z)
    assert 0 < noise.epsilon(0) < noise.defence.epsilon({0.25: 3})
    nopeek = ClientCut(PrivacySpec(defence=NopeekDefence(kind="nopeek", alpha=0.5)))
    x = torch.randn(4, 3)
    nopeek.release(Tag(1, 0, 0), x, z, rate=0.25)
    leak = nopeek.take_leak(Tag(1, 0, 0))
    assert leak[0] is x and leak[1] is z and nopeek.take_leak(Tag(1, 0, 0)) is None and nopeek.dp_releases == {}
    assert nopeek.nopeek_loss(leak).requires_grad
    assert ClientCut(None).defence is None and not ClientCut(None).accounted


def test_the_executor_runs_a_list_of_clients_in_order_with_their_flops():
    ex = Executor(seed=0)
    assert ex.device == torch.device("cpu")
    a, b = torch.nn.Linear(3, 5), torch.nn.Linear(3, 5)
    xa, xb = torch.randn(4, 3), torch.randn(2, 3)
    (oa, fa), (ob, fb) = ex.forward([Forward(("fwd", (4, 3)), a, xa), Forward(("fwd", (2, 3)), b, xb)])
    assert torch.equal(oa, a(xa)) and torch.equal(ob, b(xb))
    assert fa == FlopCache().run(("k",), lambda: a(xa))[1] == 2 * 4 * 3 * 5 and fb == 2 * 2 * 3 * 5
    ga, gb = torch.ones_like(oa), torch.ones_like(ob)
    fl = ex.backward([Backward(("bwd", (4, 5)), oa, ga), Backward(("bwd", (2, 5)), ob, gb)])
    assert a.weight.grad is not None and b.weight.grad is not None and fl[0] > 0 and fl[0] == 2 * fl[1]
    assert torch.allclose(a.weight.grad, ga.T @ xa)
    value, flops = ex.run(("own",), lambda: a(xa).sum())
    assert flops == fa and value.ndim == 0


def test_the_executor_draws_each_clients_randomness_from_its_own_stream():
    """A client's stream depends on (run seed, client, salt) only, and leaves the caller's generator as it was."""
    def draw(ex, cid, *salt):
        with ex.seeded(cid, *salt):
            return torch.rand(3)

    torch.manual_seed(5)
    before = torch.get_rng_state()
    ex = Executor(seed=1)
    first = draw(ex, 3, 0, 2)
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(7)  # what ran before on the host changes nothing
    assert torch.equal(draw(Executor(seed=1), 3, 0, 2), first)
    assert not torch.equal(draw(ex, 4, 0, 2), first) and not torch.equal(draw(ex, 3, 0, 3), first)
    assert not torch.equal(draw(Executor(seed=2), 3, 0, 2), first)
