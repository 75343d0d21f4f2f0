"""The user surface: `raysplit list`, `raysplit compare`, cluster.yaml against Ray's own schema."""

from __future__ import annotations

import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from raysplit.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_list_shows_required_names(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ["splitnn", "psl", "sflv1", "sflv2", "fedavg", "sglr", "cyclepsl", "cyclesfl", "cyclesglr", "hydra",
                 "sflv3", "multihead", "gas", "fedbuff", "ca2fl", "fedasync", "minibatch_sfl", "s2fl", "semisfl",
                 "fedswitch_sl", "supervised_only", "semifl", "ampere", "pipar", "splitgp", "sflv1_scaffold",
                 "vit_small", "device_dirichlet", "mergesfl",
                 "femnist_cnn", "celeba_cnn", "shakespeare_lstm", "resnet9", "alexnet_gas", "vgg16_bn_gas",
                 "semisfl_cnn", "alexnet2", "mobilenet_v1", "mobilenet_v3_large", "resnet18", "resnet101",
                 "cnn_small", "fashion_mnist", "digits", "cifar10", "cifar100", "svhn", "femnist", "shakespeare",
                 "synthetic", "iid", "dirichlet", "shards", "dominant_label"]:
        assert f"  {name}" in out, name


def test_compare_prints_known_runs(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'c.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("cmp")
    # psl's run is one a store written before metric names were grouped holds (accuracy, sim_time, bytes_up)
    for alg, accs, names in (("sflv2", [0.5, 0.7, 0.6], ("eval/accuracy", "time/sim", "comm/bytes_up")),
                             ("psl", [0.4, 0.45, 0.5], ("accuracy", "sim_time", "bytes_up"))):
        with mlflow.start_run(run_name=f"run-{alg}"):
            mlflow.log_params({"algorithm.name": alg, "model.name": "cnn_small", "data.dataset": "digits",
                               "seed": 0, "resolved.cut_name": "conv1"})
            for i, a in enumerate(accs):
                mlflow.log_metrics(dict(zip(names, (a, 10.0 * (i + 1), 1000.0))), step=i)
    plot = tmp_path / "cmp.png"
    assert main(["compare", "cmp", "--tracking-uri", uri, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out.splitlines()
    header = out[0].split()
    rows = {line.split()[1]: dict(zip(header, line.split())) for line in out[1:3]}
    assert rows["run-sflv2"]["algorithm"] == "sflv2" and rows["run-psl"]["algorithm"] == "psl"
    assert float(rows["run-sflv2"]["eval/accuracy"]) == 0.6 and float(rows["run-sflv2"]["best"]) == 0.7
    assert float(rows["run-psl"]["eval/accuracy"]) == 0.5 and rows["run-psl"]["rounds"] == "3"
    assert rows["run-psl"]["time/sim"] == "30" and float(rows["run-psl"]["best"]) == 0.5
    assert plot.stat().st_size > 0


def test_compare_unknown_experiment_is_one_line_naming_the_ones_there(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'e.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("digits")
    assert main(["compare", "nope", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("raysplit")]  # MLflow's own store-setup lines aside
    assert "Traceback" not in err and len(ours) == 1, err
    assert "no MLflow experiment 'nope'" in ours[0] and "experiments there: Default, digits" in ours[0], ours


def test_compare_labels_a_sweeps_runs_by_what_was_swept(tmp_path, capsys):
    """Runs that differ in the learning rate (and, as every sweep's trials do, in where they wrote): the table gets
    a column for the learning rate and none for the output paths, and the plot's legend names the swept value."""
    from raysplit.comparison import differing, runs_table

    uri = f"sqlite:///{tmp_path / 's.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("grid")
    for i, lr in enumerate((0.1, 0.01)):
        with mlflow.start_run(run_name=f"trainable_{i:05d}"):
            mlflow.log_params({"algorithm.name": "sflv1", "train.optimizer.lr": lr, "seed": 0,
                               "tracking.output_dir": f"outputs/trial_{i}", "resolved.cut_index": i})
            mlflow.log_metrics({"eval/accuracy": 0.5 + lr}, step=0)
    assert differing(runs_table("grid", uri)) == ["train.optimizer.lr"]
    plot = tmp_path / "grid.png"
    assert main(["compare", "grid", "--tracking-uri", uri, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out.splitlines()
    header = out[0].split()
    assert header[-1] == "train.optimizer.lr" and not any(h.startswith("tracking") for h in header)
    assert sorted(line.split()[-1] for line in out[1:3]) == ["0.01", "0.1"]
    import matplotlib.pyplot as plt

    from raysplit import comparison as compare

    seen = {}
    real = plt.Axes.legend

    def spy(ax, *a, **k):
        seen["labels"] = [line.get_label() for line in ax.get_lines()]
        seen["ticks"] = ax.xaxis.get_major_locator()
        return real(ax, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt.Axes, "legend", spy)
        compare.compare_runs("grid", uri, plot=str(plot))
    assert [lab.split(" (")[0] for lab in seen["labels"]] == ["train.optimizer.lr=0.1", "train.optimizer.lr=0.01"]
    assert seen["ticks"]._integer  # whole rounds on the axis


def test_a_sweeps_legend_stays_off_the_runs_and_names_no_method_only_param(tmp_path):
    """Issue 57: a sweep over methods (SFLV2 with its own order/phi beside SFLV1 and SFLV1 with batched copies):
    neither the table nor the legend names a method's own parameter that only tells its method apart; twelve runs'
    legend lies under the axes (never over a run's points) and inside the saved figure."""
    from raysplit.comparison import differing, plot_rows

    def row(i, params):
        hist = [(r, 0.3 + 0.05 * r + 0.01 * i) for r in range(10)]
        return {"run_id": f"{i:08d}", "name": f"trainable_{i:05d}", "algorithm": params["algorithm.name"],
                "_params": params, "_history": hist, "eval/accuracy": hist[-1][1]}

    rows = [row(i, {"algorithm.name": alg, "train.optimizer.lr": lr, "seed": 0,
                    **({"algorithm.order": "cyclic", "algorithm.phi": 1} if alg == "sflv2" else
                       {"algorithm.batched_copies": False})})
            for i, (alg, lr) in enumerate((a, lr) for a in ("sflv2", "sflv1") for lr in (0.1, 0.03, 0.01, 0.003,
                                                                                         0.001, 0.0003))]
    varied = differing(rows)
    assert varied == ["algorithm.name", "train.optimizer.lr"], varied
    axes, legend = plot_rows(rows, "eval/accuracy", None, varied, str(tmp_path / "sweep.png"))
    assert legend.y1 <= axes.y0 and legend.width > 0, (axes, legend)  # wholly below the axes
    from PIL import Image

    w, h = Image.open(tmp_path / "sweep.png").size
    assert h > 4 * 110 * 0.9, (w, h)  # the saved figure grew to hold the legend


def test_cluster_yaml_passes_rays_validator():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(cfg))
    types = cfg["available_node_types"]
    assert any("server" in t.get("resources", {}) for t in types.values())
    assert any("client" in t.get("resources", {}) for t in types.values())
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)  # token auth on every node
    assert any(dst.endswith(".ray/auth_token") for dst in cfg["file_mounts"])
    import jsonschema

    broken = dict(cfg, max_workers="many")
    with pytest.raises(jsonschema.ValidationError, match="many"):
        validate_config(prepare_config(broken))


@pytest.mark.subprocess
def test_untracked_run_needs_no_mlflow(tmp_path):
    """tracking.enabled=false: a run completes in a process where importing mlflow fails (e.g. a GPU box
    without it), and returns its metrics."""
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["mlflow"] = None  # any 'import mlflow' now raises ImportError
sys.path.insert(0, {str(Path(__file__).parent)!r})
from helpers import make_config
from raysplit.experiment import run_experiment
cfg = make_config(__import__("pathlib").Path({str(tmp_path)!r}), "sqlite:///unused.db",
                  **{{"runtime.backend": "local", "tracking.enabled": False, "train.rounds": 1}})
rounds = []
res = run_experiment(cfg, on_round=lambda r, m: rounds.append(r))
assert rounds == [0] and 0 <= res["eval/accuracy"] <= 1, res
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]
    assert not (tmp_path / "unused.db").exists()


@pytest.mark.subprocess
def test_gpus_this_machine_lacks_are_refused_before_ray_starts(tmp_path):
    """Issue 57: ``runtime.server.num_gpus=1`` without a GPU was refused only after Ray had started (19 s), with exit
    code 1; for a private local Ray it is a configuration error (exit 2) before Ray starts, naming the keys."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "raysplit.cli", "run", "configs/digits.yaml", "runtime.server.num_gpus=64",
                        f"tracking.uri=sqlite:///{tmp_path / 'm.db'}", f"tracking.output_dir={tmp_path}"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-2000:]
    assert "runtime.server.num_gpus=64" in out and "GPU(s); this machine has" in out, out[-2000:]
    assert "Started a local Ray instance" not in out and not (tmp_path / "m.db").exists()


def test_check_ui_counts_a_chart_only_once_it_has_drawn_its_line():
    """Issue 57: `make check-ui` passed while the charts were loading spinners; it now needs eval/accuracy's line."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_ui import chart_drawn

    def chart(metric, body):
        return f'<div><h4 class="t" title="{metric}">{metric.split("/")[1]}</h4></div><div>{body}</div>'

    line = '<g class="lines"><path class="js-line" d="M12.95,195.75L171.05,14.25" style="x"></path></g>'
    spinner = '<div class="spinner" aria-label="loading"></div>'
    drawn = chart("eval/accuracy", line) + chart("eval/loss", line)
    waiting = chart("eval/accuracy", spinner) + chart("eval/loss", line)  # the next chart's line is not its own
    assert chart_drawn(drawn, "eval/accuracy") and not chart_drawn(waiting, "eval/accuracy")
    assert not chart_drawn(chart("eval/accuracy", '<path class="js-line" d="M1,2"></path>'), "eval/accuracy")
    assert not chart_drawn(drawn, "eval/mcc")


def test_rounds_are_named_one_way_the_bar_counts_rounds_done(tmp_path, capfd):
    """Issue 57: the bar counted from 1 and everything else from 0 ("in round 2" right after the bar showed 2/6).
    Rounds are named from 0 everywhere; the bar says it counts the rounds done."""
    from helpers import make_config

    from raysplit.experiment import run_experiment

    run_experiment(make_config(tmp_path, f"sqlite:///{tmp_path / 'm.db'}", **{
        "runtime.backend": "local", "train.rounds": 2, "tracking.progress": True}))
    err = capfd.readouterr().err
    assert "sflv2, rounds done" in err and "2/2" in err, err[-1500:]
    from raysplit.errors import ActorFailure
    from raysplit.runtime.driver.drivers import RoundGuard

    guard = RoundGuard.__new__(RoundGuard)
    guard.keeper, guard.restarts, guard.max_retries = None, 0, 0
    with pytest.raises(ActorFailure, match=r"^client actor 1 died in round 2 \(2 done before it; rounds count "
                                           r"from 0\); not restarted"):
        guard.recover(ActorFailure("client actor 1 died"), 2)


def test_the_python_apis_rounds_count_from_0_and_the_bar_shows_no_nan(tmp_path, capfd):
    """Issue 70 item 6: ``RunResult.rounds`` was indexed from 1 while MLflow's steps counted from 0; and the bar
    showed ``acc=nan`` until the first evaluation. Rounds are indexed as MLflow steps them; the bar shows the last
    evaluated accuracy, and none before the first evaluation."""
    from helpers import make_config

    import raysplit

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    result = raysplit.run(make_config(tmp_path, uri, **{
        "runtime.backend": "local", "train.rounds": 3, "eval.every": 2, "tracking.progress": True}))
    err = capfd.readouterr().err
    assert list(result.rounds.index) == [0, 1, 2] and result.rounds.index.name == "round"
    steps = [m.step for m in mlflow.tracking.MlflowClient(uri).get_metric_history(result.run_id, "train/loss")]
    assert steps == list(result.rounds.index)
    assert "nan" not in err and "acc=" in err, err[-1500:]
    evaluated = result.rounds["eval/accuracy"].dropna()
    assert list(evaluated.index) == [1, 2]  # every 2nd round (round 1) and after the last
