"""LoRA adapters after setup (issue 71, item 3): only the adapters travel, aggregate and checkpoint; every actor
builds the frozen base once and the clients it hosts share it. Tiny models (2 blocks, width 32), the local
backend (the hosts in this process, so their modules can be inspected); no Ray, no network."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import make_config
from raysplit.errors import ConfigError
from raysplit.models import AdapterConfig, LMConfig, build_causal_lm, build_model
from raysplit.models import adapters
from raysplit.models.adapters import base_digest, copy_sharing_base, frozen_tensors
from raysplit.models.causal_lm import shared_base_model
from raysplit.runtime.batched import stack_own
from raysplit.runtime.plan import ModelFacts

VOCAB = 100

# a tiny split GPT-2 on four small fortune categories (tests/test_lm_runs.py's), two clients on one host
LM = {"data.num_clients": 2, "data.partition.name": "natural", "data.test_fraction": 0.0,
      "data.text.corpus": "fortunes", "data.text.categories": ["goedel", "magic", "paradoxum", "riddles"],
      "data.text.context_length": 48, "data.text.test_fraction": 0.2, "data.text.tokenizer.vocab_size": 300,
      "model.cut": "block1", "model.lm.family": "gpt2", "model.lm.layers": 2, "model.lm.width": 32,
      "model.lm.heads": 2, "model.lm.max_positions": 48, "model.lm.adapter.rank": 4,
      "model.lm.adapter.target_modules": ["c_attn", "c_fc", "lm_head"], "train.batch_size": 8,
      "train.local_steps": 2, "train.rounds": 2, "train.optimizer.name": "adam", "train.optimizer.lr": 0.01,
      "eval.batch_size": 64, "runtime.backend": "local", "runtime.num_workers": 1, "tracking.enabled": False}


def lm_config(tmp_path, **over):
    return make_config(tmp_path, None, **{**LM, **over})


def tiny(family: str = "gpt2", **kw) -> LMConfig:
    return LMConfig(family=family, layers=2, width=32, heads=4, vocab_size=VOCAB, max_positions=32, **kw)


def nudged(model):
    """``model`` with its trainable weights moved off their initial values (LoRA B starts at zero)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ptrs(tensors) -> set[int]:
    return {t.data_ptr() for t in tensors}


# ------------------------------------------------------------------------------------------ the building blocks
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_an_adapted_parts_state_is_its_trainable_weights(family):
    """With LoRA a part's state_dict is its adapters (plus adapter.trainable_modules); loading one keeps the
    frozen base, even where the state names base entries; full fine-tuning keeps every weight in the state."""
    torch.manual_seed(0)
    model = nudged(build_causal_lm(tiny(family, adapter=AdapterConfig(trainable_modules=["norm" if family == "llama"
                                                                                          else "ln_f"]))))
    client, server = model.split("block1")
    for part in (client, server):
        keys = list(part.state_dict())
        trainable = [n for n, p in part.named_parameters() if p.requires_grad]
        assert keys == trainable and all("lora_" in k for k in keys if ".ln_f." not in k and ".norm." not in k)
    assert any(".ln_f." in k or ".norm." in k for k in server.state_dict())  # the user's trainable module
    torch.manual_seed(1)
    fresh = build_causal_lm(tiny(family, adapter=AdapterConfig(trainable_modules=["norm" if family == "llama"
                                                                                   else "ln_f"])))
    f_client, f_server = fresh.split("block1")
    base = {k: v.clone() for k, v in fresh.hf_model.state_dict().items() if "lora_" not in k}
    poisoned = {**server.state_dict(), "2.layer.mlp.c_proj.weight" if family == "gpt2"
                else "2.layer.mlp.down_proj.weight": torch.zeros(1)}  # a base entry in a state: ignored
    f_client.load_state_dict(client.state_dict())  # strict: the frozen entries are not missing
    f_server.load_state_dict(poisoned)
    for k, v in fresh.hf_model.state_dict().items():
        if "lora_" in k or ".ln_f." in k or k.startswith("model.norm"):
            assert torch.equal(v, model.hf_model.state_dict()[k]), k  # the trainable state arrived
        else:
            assert torch.equal(v, base[k]), k  # the frozen base is the one it was built with
    full = build_causal_lm(tiny(family, adapter=AdapterConfig(kind="full")))
    assert len(full.state_dict()) > len(model.state_dict()) and not adapters.is_adapter_only(full)
    assert ("blocks.0.wte.weight" if family == "gpt2" else "blocks.0.embed_tokens.weight") in full.state_dict()
    assert adapters.is_adapter_only(client)


def test_copies_share_one_frozen_base():
    """Two copies from the process's template: every frozen tensor the same storage, the adapters their own; the
    base is the driver's (seeded build, same digest and outputs); a digest that differs is an error naming the
    source; a model without adapters is copied whole."""
    cfg = tiny(adapter=AdapterConfig(target_modules=["c_attn", "lm_head"]))
    a = shared_base_model(cfg, vocab_size=None, seed=3)
    b = shared_base_model(cfg, vocab_size=None, seed=3)
    frozen_a, frozen_b = frozen_tensors(a), frozen_tensors(b)
    assert frozen_a and ptrs(frozen_a) == ptrs(frozen_b)
    lora_a = [p for p in a.parameters() if p.requires_grad]
    lora_b = [p for p in b.parameters() if p.requires_grad]
    assert lora_a and not ptrs(lora_a) & ptrs(lora_b)
    assert a.hf_model.transformer.wte.weight is a.hf_model.lm_head.base_layer.weight  # the tie kept in a copy
    params, buffers = stack_own([a, b])  # what packed clients stack: the adapters only
    assert set(params) == {n for n, p in a.named_parameters() if p.requires_grad} and not buffers
    assert all(v.shape[0] == 2 and v.requires_grad for v in params.values())
    torch.manual_seed(3)
    driver = nudged(build_causal_lm(cfg))  # what prepare builds: the run's seed, then the model
    assert base_digest(a) == base_digest(driver)
    a.load_state_dict(driver.state_dict())
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a(ids), driver(ids), rtol=0, atol=0)
        before = b(ids)
        for p in lora_a:
            p.add_(1.0)
        torch.testing.assert_close(b(ids), before, rtol=0, atol=0)  # b's adapters did not move with a's
    with pytest.raises(RuntimeError, match=r"random initial weights, seed 4.*differs from the driver's"):
        shared_base_model(cfg, vocab_size=None, seed=4, digest=base_digest(a))
    cnn = build_model("cnn_small", 10, (1, 8, 8))
    twin = copy_sharing_base(cnn)
    assert not frozen_tensors(cnn) and not ptrs(cnn.parameters()) & ptrs(twin.parameters())
    assert all(torch.equal(x, y) for x, y in zip(cnn.state_dict().values(), twin.state_dict().values()))


# -------------------------------------------------------------------------------------------------- the runtime
def _hosts(cfg):
    from raysplit.experiment import prepare
    from raysplit.runtime import runtime_for

    p = prepare(cfg)
    return p, runtime_for(cfg.runtime, p.inputs)


def test_two_clients_of_one_host_share_the_base(tmp_path):
    """PSL (every client keeps its own client part) after a round: the host's two clients' modules share every
    frozen tensor (same data_ptr) and the server's per-client copies share theirs; the adapters, the clients' own
    states and their optimizer states are their own and hold only adapters."""
    cfg = lm_config(tmp_path, **{"algorithm.name": "psl", "train.rounds": 1, "data.test_fraction": 0.2})
    p, rt = _hosts(cfg)
    try:
        driver = p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed)
        driver.run(0, 1, lambda r, st: None)
        host = rt.backend.workers[0]
        assert sorted(host.data.train_idx) == [0, 1]
        m0, m1 = (host.slots.activate(c).module for c in (0, 1))
        assert m0 is not m1 and frozen_tensors(m0) and ptrs(frozen_tensors(m0)) == ptrs(frozen_tensors(m1))
        l0 = [q for q in m0.parameters() if q.requires_grad]
        l1 = [q for q in m1.parameters() if q.requires_grad]
        assert not ptrs(l0) & ptrs(l1) and any(not torch.equal(x, y) for x, y in zip(l0, l1))  # trained apart
        for c in (0, 1):
            assert host.states.own[c] and all("lora_" in k for k in host.states.own[c])
            moments = [t for st in host.states.opt_state[c]["state"].values() for t in st.values()
                       if torch.is_tensor(t) and t.dim()]
            assert moments and sum(t.numel() for t in moments) == 2 * sum(q.numel() for q in l0)  # Adam: 2 each
        server = rt.backend.server
        server.models.fork([0, 1])
        c0, c1, main = (server.models[k].module for k in (0, 1, "main"))
        assert ptrs(frozen_tensors(c0)) == ptrs(frozen_tensors(c1)) == ptrs(frozen_tensors(main))
        assert not ptrs(q for q in c0.parameters() if q.requires_grad) & ptrs(
            q for q in main.parameters() if q.requires_grad)
    finally:
        rt.shutdown()


def _old_behaviour(monkeypatch):
    """Before adapter-only states: every weight in a state, a fresh model (its own base) per built part."""
    monkeypatch.setattr(adapters, "mark_adapter_only", lambda model: None)
    monkeypatch.setattr(ModelFacts, "shares_base", property(lambda self: False))


def test_adapter_only_runs_as_full_states_did_and_sends_the_adapters(tmp_path, monkeypatch, method="sflv1"):
    """SFLV1 (per-client server copies averaged, client parts averaged) with a shared base and adapter-only states
    gives the metrics the full states and per-client models gave (float rounding); the
    model traffic is the adapters' bytes: the old run's bytes times adapter / whole client part (so the simulated
    time is shorter)."""
    from raysplit.experiment import run_experiment
    from raysplit.metrics import WALL_CLOCK

    new = run_experiment(lm_config(tmp_path / "a", **{"algorithm.name": method}))
    with monkeypatch.context() as m:
        _old_behaviour(m)
        old = run_experiment(lm_config(tmp_path / "b", **{"algorithm.name": method}))
    bytes_timed = {k for k in new if k.startswith(("comm/", "time/sim"))}  # fewer bytes, less simulated time
    for k, v in new.items():
        if k in WALL_CLOCK or k == "run_id" or k in bytes_timed or not isinstance(v, float):
            continue
        assert v == pytest.approx(old[k], rel=1e-5, abs=1e-7), k
    assert new["time/sim_round"] < old["time/sim_round"]
    adapter = _client_init_bytes(lm_config(tmp_path / "c", **{"algorithm.name": method}))
    with monkeypatch.context() as m:
        _old_behaviour(m)
        whole = _client_init_bytes(lm_config(tmp_path / "d", **{"algorithm.name": method}))
    assert 0 < 5 * adapter < whole
    assert new["comm/bytes_up_model"] > 0
    assert new["comm/bytes_up_model"] * whole == old["comm/bytes_up_model"] * adapter
    assert new["comm/bytes_up_activations"] == old["comm/bytes_up_activations"]


def _client_init_bytes(cfg) -> int:
    from raysplit.experiment import prepare
    from raysplit.runtime import transport

    return transport.state_nbytes(prepare(cfg).inputs.client_init)


def test_a_checkpoint_holds_the_adapters_and_names_the_base(tmp_path):
    """The checkpoint's client and server states are adapters; it names the base's source, seed and digest, and a
    resume over another base is one error before any actor starts."""
    from raysplit.experiment import load_checkpoint_file, run_experiment

    cfg = lm_config(tmp_path, **{"algorithm.name": "sflv2", "train.rounds": 1, "tracking.enabled": True,
                                 "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    final = run_experiment(cfg)
    path = tmp_path / "outputs" / final["run_id"] / "checkpoint.pt"
    ckpt = load_checkpoint_file(path)
    assert ckpt["base"]["seed"] == 0 and ckpt["base"]["source"].startswith("model.lm") and ckpt["base"]["digest"]
    worker = ckpt["runtime"]["workers"][0]
    assert worker["global"] and all("lora_" in k for k in worker["global"])
    main_state, _ = ckpt["runtime"]["server"]["models"]["main"]
    assert main_state and all("lora_" in k for k in main_state)
    bad = copy.deepcopy(ckpt)
    bad["base"]["digest"] = "0" * 16
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match=r"model\.lm: the checkpoint's adapters were trained over the frozen base"):
        run_experiment(cfg, checkpoint_file=tmp_path / "bad.pt")


# --------------------------------------------------------------------------------------- packed clients (item 8)
def _psl_states(cfg):
    """PSL for one round through the runtime: each client's own adapters, the server's state, the host's counts."""
    from raysplit.runtime import transport

    p, rt = _hosts(cfg)
    try:
        driver = p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed)
        driver.run(0, 1, lambda r, st: None)
        host = rt.backend.workers[0]
        own = {c: {k: v.clone() for k, v in host.states.own[c].items()} for c in (0, 1)}
        server = transport.unpack_state(rt.backend.server.get_state().state)
        return own, server, host.executor.pack_counts()
    finally:
        rt.shutdown()


def test_packed_clients_over_one_base_equal_one_after_another(tmp_path):
    """runtime.pack_clients=true: a host's two clients forward and back as one vmapped computation over the one
    frozen base (only the adapters stacked); their adapters and the server's after a round equal the clients
    computed one after another, to float rounding. The plain split: a U-shaped split's step runs one client at a
    time (its pooled steps are not built)."""
    base = {"algorithm.name": "psl", "train.rounds": 1, "data.test_fraction": 0.2, "model.lm.split": "plain"}
    one_by_one = _psl_states(lm_config(tmp_path / "a", **base, **{"runtime.pack_clients": False}))
    packed = _psl_states(lm_config(tmp_path / "b", **base, **{"runtime.pack_clients": True}))
    assert one_by_one[2]["packed_steps"] == 0
    assert packed[2]["packed_steps"] > 0 and packed[2]["unpackable"] is None
    for c in (0, 1):
        assert set(packed[0][c]) == set(one_by_one[0][c])
        for k, v in one_by_one[0][c].items():
            torch.testing.assert_close(packed[0][c][k], v, rtol=1e-4, atol=1e-6, msg=k)
    assert all("lora_" in k for k in packed[1])
    for k, v in one_by_one[1].items():
        torch.testing.assert_close(packed[1][k], v, rtol=1e-4, atol=1e-6, msg=k)
