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
