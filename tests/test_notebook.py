"""docs/notebook.md runs: its code blocks, executed in order in a scratch directory (a copy of configs/, the MLflow
store and outputs there), use the Python API as the page says (a run, its per-round table, compare, a refused key),
so a page that drifts from raysplit.run / raysplit.compare fails here."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import raysplit
from raysplit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "notebook.md"


def test_the_notebook_page_runs(tmp_path, monkeypatch, capsys):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 3, f"docs/notebook.md should hold 3 python blocks, found {len(blocks)}"
    page: dict = {"__name__": "docs_notebook"}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), page)
    out = capsys.readouterr().out
    assert "RunResult(run_id=" in out and "unknown key 'train.roundz'" in out
    assert (tmp_path / "mlflow.db").is_file()  # the store went where the page's user is, not into the repository
    assert len(page["table"].runs) == 2 and page["again"].final != page["result"].final  # another lr, another run


def test_the_api_takes_dicts_configs_and_keywords_alike(tmp_path, monkeypatch):
    from raysplit.config import load_config
    from raysplit.pyapi import _config, _overrides

    want = load_config(ROOT / "configs/digits.yaml", {"train.rounds": 2, "train.optimizer.lr": 0.5})
    over = _overrides({"train.rounds": 2}, {"train__optimizer__lr": 0.5})
    assert over == {"train.rounds": 2, "train.optimizer.lr": 0.5}
    assert _config(ROOT / "configs/digits.yaml", over) == want
    assert _config(load_config(ROOT / "configs/digits.yaml"), over) == want
    import yaml

    assert _config(yaml.safe_load((ROOT / "configs/digits.yaml").read_text()), over) == want
    with pytest.raises(ConfigError, match="train.roundz"):
        _config(ROOT / "configs/digits.yaml", {"train.roundz": 2})
    with pytest.raises(TypeError, match="a path, a dict or an ExperimentConfig"):
        _config(3, {})
    assert callable(raysplit.compare) and callable(raysplit.sweep)  # the functions, not the modules
    import importlib

    importlib.import_module("raysplit.comparison")  # importing the modules keeps raysplit.compare the function
    importlib.import_module("raysplit.tuning")
    assert raysplit.compare.__module__ == raysplit.sweep.__module__ == "raysplit.pyapi"


def test_run_experiment_takes_a_config_files_path(tmp_path):
    """Issue 57: ``run_experiment("configs/first.yaml")`` failed with an AttributeError on the string."""
    import yaml

    from raysplit.experiment import run_experiment

    raw = yaml.safe_load((ROOT / "configs/first.yaml").read_text())
    raw["train"]["rounds"] = 1
    raw["runtime"] = {"backend": "local"}
    raw["tracking"] = {"enabled": False, "output_dir": str(tmp_path / "out")}
    path = tmp_path / "first.yaml"
    path.write_text(yaml.safe_dump(raw))
    final = run_experiment(str(path))
    assert final["eval/accuracy"] > 0 and "run_id" in final
