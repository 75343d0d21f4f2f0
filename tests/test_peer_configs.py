"""The parity runners' raysplit configs are the results pages' configs with only their stated reductions."""

from __future__ import annotations

from pathlib import Path

from raysplit.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_the_gas_parity_config_is_gas_md_s_config_with_its_stated_reductions():
    """benchmarks/peers/gas/raysplit.yaml (raysplit's side beside eejiarong/GAS) differs from configs/gas/fmnist.yaml
    only where its header says: 12 rounds, evaluated every 2, no server charge on the clock, one process, no
    checkpoints, its own experiment; a change to the page's config that the parity config misses fails here."""
    page = flat(load_config(ROOT / "configs" / "gas" / "fmnist.yaml").model_dump())
    peer = flat(load_config(ROOT / "benchmarks" / "peers" / "gas" / "raysplit.yaml").model_dump())
    differ = {k for k in page.keys() | peer.keys() if page.get(k) != peer.get(k)}
    stated = {"name", "train.rounds", "eval.every", "clock.charge_server"}
    assert {k for k in differ if not k.startswith(("runtime.", "tracking."))} == stated, differ
    assert (peer["train.rounds"], peer["eval.every"], peer["clock.charge_server"]) == (12, 2, False)
    assert peer["runtime.backend"] == "local" and peer["runtime.torch_threads"] == 1


def test_the_splitlora_parity_runner_writes_raysplits_blocks_and_base_in_their_format(tmp_path, monkeypatch):
    """benchmarks/peers/splitlora/run.py (FDU-INC/Split_LoRA beside raysplit): its overrides validate against
    configs/llm/splitlora.yaml with the code's schedule (a shared server, uniform averaging, cut after block 3 of 4,
    LoRA on c_attn); each client's jsonl holds that client's raysplit blocks as one context token and the rest as
    completion (their clm mask then scores the block's next tokens, as raysplit's loss does), the held-out file the
    held-out blocks; init.pt is the saved pretrained base, without the transformer. prefix, the head or adapters."""
    import importlib.util
    import json

    import torch
    from safetensors.torch import load_file

    from raysplit.data.text import load_text_partitioned

    spec = importlib.util.spec_from_file_location("splitlora_peer", ROOT / "benchmarks/peers/splitlora/run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    monkeypatch.setattr(run, "PRETRAIN_STEPS", 1)
    cfg = load_config(run.BASE, run.overrides(0, 1))
    assert (cfg.algorithm.server_side, cfg.train.aggregation.weights, cfg.model.cut, cfg.model.lm.layers,
            cfg.model.lm.adapter.target_modules, cfg.train.local_steps) == ("shared", "uniform", "block3", 4,
                                                                            ["c_attn"], run.STEPS)
    made = run.inputs(cfg, 0, tmp_path)
    text = load_text_partitioned(cfg.data.text, cfg.data.partition, cfg.data.num_clients, cfg.data.test_fraction, 0)
    for c in range(run.CLIENTS):
        rows = [json.loads(line) for line in (tmp_path / f"train{c}.jsonl").read_text().splitlines()]
        assert [r["context"] + r["completion"] for r in rows] == text.x_train[text.train_idx[c]].tolist()
        assert all(len(r["context"]) == 1 for r in rows)
    held = [json.loads(line) for line in (tmp_path / "valid.jsonl").read_text().splitlines()]
    assert len(held) == made["heldout_blocks"] == len(text.x_test)
    init = torch.load(tmp_path / "init.pt")
    base = load_file(next((tmp_path / "base").glob("*.safetensors")))
    assert not [k for k in init if k.startswith(("transformer.", "lm_head")) or "lora" in k]
    assert set(init) == {k.removeprefix("transformer.") for k in base if not k.startswith("lm_head")}
    assert all(torch.equal(v, base["transformer." + k]) for k, v in init.items())
