"""Compare the runs of an MLflow experiment: a table of final metrics and an optional overlay plot. Columns and
legends name the params in which the runs differ (a sweep's swept values), not trial names."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from raysplit.errors import ConfigError
from raysplit.metrics import grouped_name, short_name
from raysplit.tracking import resolve_uri
from raysplit import tags

COLUMNS = [("algorithm", "params.algorithm.name"), ("model", "params.model.name"), ("cut", "params.resolved.cut_name"),
           ("dataset", "params.data.dataset"), ("seed", "params.seed")]
# params that differ between runs without being a choice of the user's: where each run wrote, and what was derived
DERIVED = ("tracking.", "resolved.", "partition.", "name")
SHORT = {"algorithm.name": "algorithm"}  # in a legend; a method's own parameters go without "algorithm."


def _metric(run_metrics: dict, name: str) -> str:
    """``name`` as this run logged it: the grouped name, or the short one of a run written before the groups."""
    return name if name in run_metrics or short_name(name) not in run_metrics else short_name(name)


def lower_is_better(metric: str) -> bool:
    """Whether a run's best value of ``metric`` is its lowest: a loss or a perplexity (a language model's)."""
    return metric.rsplit("/", 1)[-1] in ("loss", "perplexity")


def runs_table(experiment: str, uri: str | None = None, metric: str = "eval/accuracy",
               against: str | None = None) -> list[dict]:
    metric = grouped_name(metric)
    client = MlflowClient(resolve_uri(uri))
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ConfigError(f"no MLflow experiment {experiment!r} at {resolve_uri(uri)}; experiments there: "
                          f"{', '.join(names) or 'none'}")
    rows = []
    for run in client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]):
        p, m = run.data.params, run.data.metrics
        logged_as = _metric(m, metric)
        hist = client.get_metric_history(run.info.run_id, logged_as) if logged_as in m else []
        # a study's run goes by its arm (a sweep's arms:), another by its run name
        row = {"run_id": run.info.run_id[:8], "name": run.data.tags.get(tags.ARM) or run.info.run_name,
               "status": run.info.status}
        for col, key in COLUMNS:
            row[col] = p.get(key.split(".", 1)[1], "")
        row[metric] = m.get(logged_as)  # its last value
        row["best"] = (min if lower_is_better(metric) else max)((h.value for h in hist), default=None)
        row["rounds"] = (max(h.step for h in hist) + 1) if hist else None
        row["time/sim"] = m.get(_metric(m, "time/sim"))
        row["comm/bytes_up"] = m.get(_metric(m, "comm/bytes_up"))
        if against is not None:
            row[against] = m.get(_metric(m, against))
        row["_history"] = [(h.step, h.value) for h in sorted(hist, key=lambda h: h.step)]
        row["_params"] = dict(p)
        rows.append(row)
    return rows


def differing(rows: list[dict]) -> list[str]:
    """The params (dotted config keys) whose values are not the same in every run, derived ones left out, and so
    are those that differ only by being there: a method's own parameter (``algorithm.order`` of SFLV2 beside an
    SFLV1 run) with one value in every run that has it is told apart by ``algorithm.name`` already."""
    keys = sorted({k for r in rows for k in r["_params"]})
    return [k for k in keys if not k.startswith(DERIVED)
            and len({r["_params"][k] for r in rows if k in r["_params"]}) > 1]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def compare_runs(experiment: str, uri: str | None = None, metric: str = "eval/accuracy",
                 plot: str | None = None, against: str | None = None) -> str:
    """The runs' table; ``plot``: a PNG of ``metric`` per round (or, with ``against``, of each run's final
    ``metric`` against its final ``against``: accuracy against leakage, ``--against privacy/ssim``)."""
    return comparison(experiment, uri, metric, plot, against)[0]


def comparison(experiment: str, uri: str | None = None, metric: str = "eval/accuracy", plot: str | None = None,
               against: str | None = None) -> tuple[str, list[dict]]:
    """:func:`compare_runs`' table and the rows it was made from (with a column for each parameter that varies)."""
    metric = grouped_name(metric)
    against = grouped_name(against) if against else None
    rows = runs_table(experiment, uri, metric, against)
    if not rows:
        return f"experiment {experiment!r} has no runs", rows
    varied = differing(rows) if len(rows) > 1 else []
    shown = {key.split(".", 1)[1] for _, key in COLUMNS}
    for r in rows:  # a varied param gets a column of its own unless a fixed column shows it already
        r.update({k: r["_params"].get(k, "") for k in varied if k not in shown})
    cols = [c for c in rows[0] if not c.startswith("_")]
    table = [[_fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in table]
    if plot:
        plot_rows(rows, metric, against, varied, plot)
        lines.append(f"plot written to {plot}")
    return "\n".join(lines), rows


def plot_rows(rows: list[dict], metric: str, against: str | None, varied: list[str], path: str):
    """The overlay of :func:`comparison`: ``metric`` per round of each run (or, with ``against``, each run's final
    ``metric`` against its final ``against``), labelled by the ``varied`` params. The legend goes under the axes, in
    as many columns as fit, so that it never covers a run's points however many runs a sweep has; returns the
    figure's (axes, legend) extents in pixels, for a check."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    def label(r):
        named = ", ".join(f"{SHORT.get(k, k.removeprefix('algorithm.'))}={r['_params'].get(k, '-')}" for k in varied)
        return f"{named or r['algorithm'] + ' ' + r['name']} ({r['run_id']})"

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows if against else []:
        if r[against] is not None and r[metric] is not None:
            ax.scatter(r[against], r[metric], label=label(r))
    for r in [] if against else rows:
        if r["_history"]:
            xs, ys = zip(*r["_history"])
            ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, label=label(r))
    if not against:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole
    ax.set_xlabel(against or "round"), ax.set_ylabel(metric), ax.grid(alpha=0.3)
    longest = max((len(h) for h in ax.get_legend_handles_labels()[1]), default=1)
    legend = ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14),
                       ncol=max(1, min(3, 90 // max(longest, 1))), frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the figure grows to hold the legend
    renderer = fig.canvas.get_renderer()
    extents = (ax.get_window_extent(renderer), legend.get_window_extent(renderer))
    plt.close(fig)
    return extents


def arm_results(experiment: str, uri: str | None = None, keys: tuple[str, ...] = (), sweep: str | None = None,
                only: set[str] | None = None) -> dict[str, dict]:
    """The runs of a study's MLflow experiment by arm (the ``raysplit.arm`` tag a sweep's ``arms:`` sets), read as
    the results scripts keep them: for each arm its newest run that finished or diverged (of the sweep named
    ``sweep``, its ``raysplit.sweep`` tag, where given), as the final value of every metric,
    ``run_id``, ``curve`` = [(round, time/sim, eval/accuracy)] at the evaluated rounds and ``history`` =
    [{"round": r, key: value, ...}] of ``keys`` per round (rounds from 1). A run that diverged (FAILED on a
    non-finite loss) is a result too: accuracy NaN and ``diverged`` = its error; a run that failed otherwise, or was
    stopped, is left out. ``only``: read these arms alone."""
    client = MlflowClient(resolve_uri(uri))
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    out: dict[str, dict] = {}
    where = f"tags.`{tags.ARM}` != ''" + (f" and tags.`{tags.SWEEP}` = '{sweep}'" if sweep else "")
    for run in client.search_runs([exp.experiment_id], where, order_by=["attributes.start_time DESC"]):
        arm, error = run.data.tags.get(tags.ARM), run.data.tags.get(tags.ERROR, "")
        diverged = run.info.status == "FAILED" and error.startswith("NonFiniteLossError")
        if arm in out or (only is not None and arm not in only) or not (run.info.status == "FINISHED" or diverged):
            continue

        def history(key: str) -> dict[int, float]:
            return {h.step + 1: h.value for h in client.get_metric_history(run.info.run_id, key)}

        res: dict = dict(run.data.metrics)
        sim, acc = history("time/sim"), history("eval/accuracy")
        res["run_id"] = run.info.run_id
        res["curve"] = [(r, sim.get(r, 0.0), a) for r, a in sorted(acc.items())]
        per_key = {k: history(k) for k in keys}
        res["history"] = [{"round": r, **{k: h[r] for k, h in per_key.items() if r in h}}
                          for r in sorted(set(sim) | {r for h in per_key.values() for r in h})]
        if diverged:
            res.update({"eval/accuracy": float("nan"), "diverged": error.split(": ", 1)[-1]})
        out[arm] = res
    return out
