import pytest

from raysplit.config import ConfigError, apply_overrides, flatten, load_config


def test_unknown_key_names_the_key_and_allowed(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  rounds: 3\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "train.learning_rate" in msg and "local_steps" in msg  # names the key and what is allowed


def test_bad_value_names_the_key():
    with pytest.raises(ConfigError, match="train.rounds"):
        load_config(None, ["train.rounds=-1"])
    with pytest.raises(ConfigError, match="train.optimizer.name"):
        load_config(None, ["train.optimizer.name=rmsprop"])


def test_algorithm_params_checked_by_the_algorithm():
    with pytest.raises(ConfigError, match="algorithm.ordr"):
        load_config(None, {"algorithm": {"name": "sflv2", "ordr": "fixed"}})
    with pytest.raises(ConfigError, match="unknown algorithm.name 'nope'.*sflv2"):
        load_config(None, {"algorithm.name": "nope"})


def test_dotted_overrides_parse_yaml_scalars_and_nest():
    raw = apply_overrides({"train": {"rounds": 1}}, ["train.rounds=7", "train.optimizer.lr=1e-3",
                                                     "model.cut=conv1", "data.root=null"])
    assert raw["train"]["rounds"] == 7 and raw["train"]["optimizer"]["lr"] == 1e-3
    assert raw["model"]["cut"] == "conv1" and raw["data"]["root"] is None
    cfg = load_config(None, ["train.rounds=7", "model.cut=2"])
    assert cfg.train.rounds == 7 and cfg.model.cut == 2
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.rounds"])


def test_flatten_gives_dotted_params():
    cfg = load_config(None, [])
    flat = flatten(cfg.model_dump(mode="json"))
    assert flat["train.optimizer.lr"] == cfg.train.optimizer.lr
    assert flat["algorithm.name"] == "sflv2"


def test_participation_fraction_and_count_exclusive():
    with pytest.raises(ConfigError, match="participation"):
        load_config(None, ["train.participation.fraction=0.5", "train.participation.count=3"])


def test_shipped_configs_validate():
    from pathlib import Path

    for p in sorted(Path(__file__).parent.parent.glob("configs/**/*.yaml")):
        load_config(p)


def test_inject_fault_names_an_actor_that_exists_and_needs_ray():
    from raysplit.config import load_config

    ok = load_config(None, {"runtime.inject_fault": {"actor": "client1", "round": 2, "call": 5, "method": "ingest"}})
    assert ok.runtime.inject_fault.actor == "client1" and ok.runtime.inject_fault.method == "ingest"
    with pytest.raises(Exception, match=r"runtime.inject_fault.actor='client2': there are 2 client actors"):
        load_config(None, {"runtime.inject_fault": {"actor": "client2"}})
    with pytest.raises(Exception, match="needs runtime.backend=ray"):
        load_config(None, {"runtime.inject_fault": {"actor": "server"}, "runtime.backend": "local"})
    with pytest.raises(Exception, match="inject_fault"):
        load_config(None, {"runtime.inject_fault": {"actor": "worker0"}})
