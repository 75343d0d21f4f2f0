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

    ok = load_config(None, {"runtime.faults.inject_fault": {"actor": "client1", "round": 2, "call": 5,
                                                            "method": "ingest"}})
    assert ok.runtime.faults.inject_fault.actor == "client1" and ok.runtime.faults.inject_fault.method == "ingest"
    with pytest.raises(Exception, match=r"runtime.faults.inject_fault.actor='client2': there are 2 client actors"):
        load_config(None, {"runtime.faults.inject_fault": {"actor": "client2"}})
    with pytest.raises(Exception, match="needs runtime.backend=ray"):
        load_config(None, {"runtime.faults.inject_fault": {"actor": "server"}, "runtime.backend": "local"})
    with pytest.raises(Exception, match="inject_fault"):
        load_config(None, {"runtime.faults.inject_fault": {"actor": "worker0"}})


def test_config_reference_is_current_and_lists_every_key():
    """docs/config.md is what raysplit/config_doc.py generates today (`make config-doc` rewrites it), and it names
    every dotted key the schema accepts and every parameter of every algorithm."""
    from pathlib import Path

    from raysplit.algorithms import ALGORITHMS
    from raysplit.config import ExperimentConfig
    from raysplit.config_doc import reference, rows

    text = reference()
    page = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    assert page.read_text() == text, "docs/config.md is out of date: run `make config-doc` and commit it"
    keys = [k for k, *_ in rows(ExperimentConfig)]
    assert "runtime.faults.inject_fault.actor" in keys and "train.optimizer.lr" in keys and "data.partition.alpha" in keys
    for key in keys:
        assert f"`{key}`" in text, key
    for name, alg in ALGORITHMS.items():
        assert f"### `{name}`" in text, name
        for key in alg.Params.model_fields:
            if key != "name":
                assert f"`algorithm.{key}`" in text, (name, key)


def test_config_reference_types_and_defaults_read_as_written():
    from raysplit.config import ExperimentConfig
    from raysplit.config_doc import rows

    by_key = {k: (t, d) for k, t, d, _ in rows(ExperimentConfig)}
    assert by_key["train.optimizer.name"] == ("one of sgd, adam, adamw", "'sgd'")
    assert by_key["data.root"] == ("str or null", "null")
    assert by_key["clock.client_flops_range"] == ("[float, float]", "(1000000000.0, 10000000000.0)")
    assert by_key["runtime.server"] == ("section", "(section)")


def test_raysplit_list_config_prints_the_reference(capsys):
    from raysplit.cli import main
    from raysplit.config_doc import reference

    assert main(["list", "config"]) == 0
    assert capsys.readouterr().out == reference()


def test_each_partitioner_takes_only_its_own_keys():
    """data.partition is a discriminated union on name: a key of another partitioner is one error naming the key,
    the partitioner and what it takes; a section without name is the default partitioner's (dirichlet)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, {"data.partition": {"name": "shards", "per_client": 2, "alpha": 0.1}})
    assert str(e.value) == ("invalid config: unknown key 'data.partition.alpha' (partitioner shards); allowed here: "
                            "name, per_client (to switch partitioner, give the whole section: "
                            "data.partition={name: shards})")
    with pytest.raises(ConfigError, match="'data.partition': Input tag 'dirichlt'"):
        load_config(None, {"data.partition.name": "dirichlt"})
    with pytest.raises(ConfigError, match="'data.partition.ratio': Input should be less than or equal to 1"):
        load_config(None, {"data.partition": {"name": "dominant_label", "ratio": 1.5}})
    assert load_config(None, {"data.partition.alpha": 0.2}).data.partition.params() == {"alpha": 0.2, "min_size": 10}
    assert load_config(None, ["data.partition={name: iid}"]).data.partition.params() == {}
    assert load_config(None, {"data.partition.name": "device_dirichlet"}).data.partition.params() == {"alpha": 0.5}


def test_runtime_sections_hold_placement_transport_and_fault_policy():
    cfg = load_config(None, ["runtime.transport.kind=calls", "runtime.transport.window=2",
                             "runtime.placement.strategy=home", "runtime.faults.max_retries=0"])
    r = cfg.runtime
    assert (r.transport.kind, r.transport.window, r.placement.strategy, r.faults.max_retries) == ("calls", 2, "home", 0)
    assert not any(k in flatten(cfg.model_dump()) for k in ("runtime.window", "runtime.max_retries"))


def test_the_rdt_transport_is_refused_on_the_server_driven_path_with_the_reason():
    """Ray 2.60's gloo objects reach only tasks that take them as arguments, so ``kind: rdt`` needs the
    driver-chained path; asked for with the default ``direct_steps: true`` it is one error naming both keys."""
    with pytest.raises(ConfigError, match=r"runtime.transport.kind=rdt needs runtime.transport.direct_steps=false"):
        load_config(None, ["runtime.transport.kind=rdt"])
    cfg = load_config(None, ["runtime.transport.kind=rdt", "runtime.transport.direct_steps=false"])
    assert (cfg.runtime.transport.kind, cfg.runtime.transport.direct_steps) == ("rdt", False)


def test_old_runtime_keys_still_work_with_one_warning_each(tmp_path):
    """A config written before the runtime had sections: every old key lands in its section, each with a
    one-line FutureWarning naming the new key; a later new-style override finds the section."""
    path = tmp_path / "old.yaml"
    path.write_text("runtime:\n  transport: calls\n  window: 2\n  max_retries: 0\n  placement: home\n"
                    "  inject_fault: {actor: server}\n  spill_dir: /tmp/x\n")
    with pytest.warns(FutureWarning) as seen:
        cfg = load_config(path, ["runtime.transport.max_in_flight=8", "runtime.on_bad_client=drop"])
    r = cfg.runtime
    assert (r.transport.kind, r.transport.window, r.transport.max_in_flight) == ("calls", 2, 8)
    assert (r.placement.strategy, r.placement.spill_dir) == ("home", "/tmp/x")
    assert (r.faults.max_retries, r.faults.inject_fault.actor, r.faults.on_bad_client) == (0, "server", "drop")
    messages = sorted({str(w.message) for w in seen})
    assert "runtime.window is now runtime.transport.window (the old key still works; write the new one)" in messages
    assert "runtime.on_bad_client is now runtime.faults.on_bad_client (the old key still works; write the new one)" \
        in messages
    assert len(messages) == 7 and all("\n" not in m for m in messages)


def test_old_shorthand_override_sets_the_kind_and_keeps_the_section():
    """``runtime.transport=calls`` (the old key) onto a file with a transport section changes only the kind."""
    with pytest.warns(FutureWarning, match="runtime.transport is now runtime.transport.kind"):
        cfg = load_config(None, {"runtime.transport.window": 2, "runtime.transport": "calls"})
    assert (cfg.runtime.transport.kind, cfg.runtime.transport.window) == ("calls", 2)


def test_a_runtime_setting_given_both_ways_is_one_error_naming_both():
    with pytest.raises(ConfigError, match=r"runtime.window and runtime.transport.window are the same setting"):
        load_config(None, {"runtime": {"window": 3, "transport": {"window": 2}}})


def test_algorithm_section_is_the_methods_own_params_validated_once(monkeypatch):
    """``cfg.algorithm`` is the named method's Params (defaults filled, dumped in full), made by one validation;
    a method registered after import is known."""
    from pydantic import Field

    import raysplit.config as config
    from raysplit.algorithms import ALGORITHMS, AlgorithmParams, get_algorithm
    from raysplit.algorithms.baselines import SFLV2
    from raysplit.config import dump

    calls = []
    real = config.algorithm_params
    monkeypatch.setattr(config, "algorithm_params", lambda raw: calls.append(raw) or real(raw))
    cfg = load_config(None, ["algorithm.name=cyclesfl", "algorithm.server_epochs=2"])
    assert type(cfg.algorithm) is get_algorithm("cyclesfl").Params and cfg.algorithm.server_epochs == 2
    assert len(calls) == 1 and "server_steps: epoch" in dump(cfg)  # a default, written out with the run

    class NewParams(AlgorithmParams):
        k: int = Field(default=1, ge=1, description="a parameter of a method registered later")

    class New(SFLV2):
        name = "registered_later"
        Params = NewParams

    monkeypatch.setitem(ALGORITHMS, "registered_later", New)
    assert load_config(None, ["algorithm.name=registered_later", "algorithm.k=3"]).algorithm.k == 3
    with pytest.raises(ConfigError, match="bad value for 'algorithm.k'"):
        load_config(None, ["algorithm.name=registered_later", "algorithm.k=0"])


def test_model_and_data_options_are_checked_against_the_builders_signature():
    """Before any data is read or actor started: an unknown option or a wrong type names model.options.<key>
    (or data.options.<key>) and what the builder or loader takes; a good one arrives typed."""
    with pytest.raises(ConfigError, match=r"unknown key 'model.options.width' for model 'resnet18'; allowed: "
                                          r"cifar_stem"):
        load_config(None, ["model.name=resnet18", "model.options.width=2"])
    with pytest.raises(ConfigError, match=r"bad value for 'model.options.cifar_stem'.*boolean"):
        load_config(None, ["model.name=resnet18", "model.options.cifar_stem=maybe"])
    with pytest.raises(ConfigError, match=r"unknown key 'data.options.labels' for dataset 'cifar100'; allowed: label"):
        load_config(None, ["data.dataset=cifar100", "data.options.labels=coarse"])
    cfg = load_config(None, ["model.name=cnn_small", "model.options.channels=[8, 16]", "data.dataset=digits",
                             "data.options.test_fraction=0.3"])
    assert cfg.model.options == {"channels": (8, 16)} and cfg.data.options == {"test_fraction": 0.3}
    assert load_config(None, ["model.name=not_registered", "model.options.anything=1"]).model.options == \
        {"anything": 1}  # an unknown model is prepare's error, which lists the registered ones


def test_the_readme_config_is_the_shipped_one_and_valid():
    """The front door's example is configs/first.yaml, byte for byte, and validates (its run is seconds long)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    block = re.search(r"```yaml\n(.*?)```", (root / "README.md").read_text(), re.S).group(1)
    shipped = (root / "configs" / "first.yaml").read_text()
    assert shipped.split("\n", 1)[1] == block  # after its one comment line
    cfg = load_config(root / "configs" / "first.yaml")
    assert cfg.algorithm_name == "sflv1" and cfg.data.dataset == "digits"


def test_a_yaml_syntax_error_names_the_files_line_and_column(tmp_path):
    """Issue 57: PyYAML's message pointed at ``in "<unicode string>"``; the error names the file, the line and the
    column counted from 1, and the line's text."""
    from raysplit.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain:\n  rounds: 1\n   batch_size: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    msg = str(e.value)
    assert msg.startswith(f"config file {bad}, line 4, column 14: mapping values are not allowed here"), msg
    assert "'batch_size: 2'" in msg and "unicode string" not in msg
    bad.write_text("a: [1, 2\n")
    assert "line 2, column 1:" in str(pytest.raises(ConfigError, load_config, bad).value)
    assert main(["run", str(bad)]) == 2
