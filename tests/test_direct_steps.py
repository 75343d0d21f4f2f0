"""The actor-driven split-step path (``runtime.direct_steps``, the default) computes exactly what the
driver-chained path computes: same weights bit for bit, same simulated clocks, same per-step losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_config
from test_semantics import run_rounds


@pytest.mark.parametrize("algorithm", [
    {"name": "sflv2"}, {"name": "sflv1"}, {"name": "psl"},
    {"name": "sflv2", "order": "random"},  # steps of different clients interleaved
    {"name": "hydra", "order": "cyclic_reverse", "phi": 2},
], ids=lambda a: "-".join(map(str, a.values())))
def test_direct_steps_bit_identical_to_driver_chained(ray_session, tmp_path, mlflow_uri, algorithm):
    over = {"algorithm": algorithm, "train.rounds": 2, "train.local_steps": 3, "data.num_clients": 5,
            "train.optimizer.momentum": 0.9}
    c_d, s_d, _, st_d = run_rounds(make_config(tmp_path, mlflow_uri, **over, **{"runtime.direct_steps": True}))
    c_c, s_c, _, st_c = run_rounds(make_config(tmp_path, mlflow_uri, **over, **{"runtime.direct_steps": False}))
    for a, b in ((s_d, s_c), (c_d, c_c)):
        if a is None:
            continue
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for d, c in zip(st_d, st_c):
        assert d.t_end == c.t_end
        assert d.server["losses"] == c.server["losses"]
        assert {k: v["t_end"] for k, v in d.clients.items()} == {k: v["t_end"] for k, v in c.clients.items()}
        assert {k: v["steps"] for k, v in d.clients.items()} == {k: v["steps"] for k, v in c.clients.items()}


def test_direct_steps_local_backend_equals_ray(ray_session, tmp_path, mlflow_uri):
    """The local backend runs Runtime.split_steps as a plain loop; the Ray backend drives it from the server."""
    over = {"algorithm.name": "sflv2", "train.rounds": 2, "train.local_steps": 3}
    c_r, s_r, _, _ = run_rounds(make_config(tmp_path, mlflow_uri, **over))
    c_l, s_l, _, _ = run_rounds(make_config(tmp_path, mlflow_uri, **over, **{"runtime.backend": "local"}))
    for a, b in ((s_r, s_l), (c_r, c_l)):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_client_actor_error_in_driven_steps_surfaces_as_itself(ray_session, tmp_path, mlflow_uri):
    """An exception raised by a client host inside a server-driven sequence reaches the driver as the host's own
    exception type (not a wrapped RayTaskError)."""
    from raysplit.experiment import prepare
    from raysplit.runtime import Runtime, make_backend

    cfg = make_config(tmp_path, mlflow_uri, **{"train.local_steps": 2})
    p = prepare(cfg)
    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    try:
        rt.begin_round(0, [0, 1], 0.0)
        rt.split_steps([0, 0, 99, 99])  # client 99 does not exist: its host raises KeyError
        with pytest.raises(KeyError, match="not hosted"):
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
    host = ServerHost(i.spec, i.server_init, i.client_init, i.test_data)
    a = {k: np.array(v, copy=True) for k, v in i.client_init.items()}
    b = {k: np.array(v, copy=True) for k, v in i.client_init.items()}
    nbt = next(k for k in a if k.endswith("num_batches_tracked"))
    a[nbt], b[nbt] = np.array(2, np.int64), np.array(4, np.int64)
    out = host.aggregate(StateMsg(a, weight=1.0), StateMsg(b, weight=1.0))
    st = transport.unpack_state(out.state)
    assert st[nbt].dtype == torch.int64 and int(st[nbt]) == 3  # (2*1 + 4*1) / 2
