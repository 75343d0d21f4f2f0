"""Open a raysplit run in MLflow's own UI, in a real (headless) browser, and check what a researcher would see.

    make check-ui            (installs Debian's chromium if it is missing, then runs this script)

A tiny run (configs/first.yaml, 2 rounds, local backend) is logged to a fresh store in a temporary folder; `mlflow
server` serves it on a free local port; headless Chromium renders three pages and the script checks their text:

1. the experiment is marked for model training (``mlflow.experimentKind``), and in the UI's "Model training" view
   (``?workflowType=machine_learning``) its runs page lists the run with its dataset (name and digest);
2. the same runs page in the UI's default "GenAI" view lists it under "Training runs";
3. the run's "Model metrics" tab shows one section per metric group (eval, train, comm, compute, time, ...), the
   sections together holding every metric the run logged, the eval section one chart per eval/ metric, the
   accuracy chart drawn (its line in the page, not a loading spinner: the page is reloaded until it is, at most six
   times), and the run's overview lists eval/accuracy with its value.

Screenshots go to outputs/ui/ (ignored by git). Exit status 0 when every check passes; each failure is printed.
MLflow 3.17's UI opens an experiment in whichever view (GenAI or Model training) the browser last used (stored in
its localStorage, default GenAI); the experiment's kind tag does not switch it, so links to a run say
``?workflowType=machine_learning``.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "outputs" / "ui"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def page_text(browser: str, url: str, shot: Path, budget_ms: int = 20000, height: int = 1000,
              drawn: str | None = None, tries: int = 1) -> str:
    """The rendered page's visible text (scripts and styles removed), and a screenshot of it. MLflow draws only the
    charts in view: a taller window (``height``) draws more of them. ``drawn``: the metric whose chart must have
    drawn its line (:func:`chart_drawn`); the page is loaded up to ``tries`` times until it has (headless, MLflow
    3.17 draws a page's charts on some loads and none on others, leaving spinners), and the text is empty if it
    never did."""
    args = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--virtual-time-budget={budget_ms}", f"--window-size=1400,{height}"]
    for _ in range(tries):
        dom = subprocess.run(args + ["--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
        if drawn is None or chart_drawn(dom, drawn):
            break
    else:
        return ""
    subprocess.run(args + [f"--screenshot={shot}", url], capture_output=True, timeout=180)
    text = re.sub(r"<(style|script)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text))


def chart_drawn(dom: str, metric: str) -> bool:
    """Whether the chart of ``metric`` (its heading carries the metric's name as its title) has drawn a line of at
    least two points, a plotted trace rather than a spinner: a line path after its heading and before the next
    chart's."""
    at = dom.find(f'title="{metric}"')
    if at < 0:
        return False
    line = re.search(r'class="js-line" d="M[-\d.,]+L[-\d.,]+', dom[at:])
    other = re.search(r'<h4 [^>]*title="', dom[at + 1:])
    return line is not None and (other is None or line.start() < other.start() + 1)


def main() -> int:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("check-ui: no chromium on PATH (apt-get install chromium; make check-ui does it)", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    failures = []
    with tempfile.TemporaryDirectory(prefix="raysplit-ui-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        env = {"RAY_AUTH_MODE": "disabled", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
        subprocess.run([sys.executable, "-m", "raysplit.cli", "run", str(ROOT / "configs" / "first.yaml"),
                        "runtime.backend=local", "train.rounds=2", f"tracking.uri={uri}",
                        f"tracking.output_dir={tmp}/out", "tracking.progress=false"],
                       check=True, cwd=tmp, env=env, timeout=600)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
                                   "--host", "127.0.0.1", "--port", str(port)], cwd=tmp, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(120):
                try:
                    if urllib.request.urlopen(f"{base}/health", timeout=2).read().strip() == b"OK":
                        break
                except OSError:
                    time.sleep(1)
            else:
                print("check-ui: mlflow server did not come up", file=sys.stderr)
                return 1
            from mlflow.tracking import MlflowClient

            client = MlflowClient(base)
            exp = client.get_experiment_by_name("my-first")
            run = client.search_runs([exp.experiment_id])[0]
            digest = run.inputs.dataset_inputs[0].dataset.digest if run.inputs.dataset_inputs else "?"
            if exp.tags.get("mlflow.experimentKind") != "custom_model_development":
                failures.append(f"experiment kind tag: {exp.tags.get('mlflow.experimentKind')!r}")
            runs_url = f"{base}/#/experiments/{exp.experiment_id}/runs"
            ml = page_text(browser, f"{runs_url}?workflowType=machine_learning", OUT / "runs_model_training.png")
            if f"digits ({digest[:16]}" not in ml or run.info.run_name not in ml:
                failures.append(f"Model training view: run {run.info.run_name} with dataset digits ({digest}) "
                                f"not listed")
            genai = page_text(browser, runs_url, OUT / "runs_genai_view.png")
            if "Training runs" not in genai:
                failures.append("GenAI view: the runs page has no 'Training runs'")
            n = len(run.data.metrics)
            metrics = page_text(browser, f"{base}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}/"
                                f"model-metrics?workflowType=machine_learning", OUT / "run_metrics.png", height=4000,
                                drawn="eval/accuracy", tries=6)
            if not metrics:
                failures.append("Model metrics tab: the eval/accuracy chart drew no line in 6 loads (spinners)")
            # one collapsible section per group, "eval (7)", "eval/label_acc (10)", ... together every metric
            sections = {g: int(k) for g, k in re.findall(r"\b([a-z_]+(?:/[a-z_]+)?) \((\d+)\)", metrics)}
            missing = {"eval", "train", "comm", "compute", "time"} - set(sections)
            if missing or sum(sections.values()) != n:
                failures.append(f"Model metrics tab: sections {sections} (missing {sorted(missing)}), "
                                f"the run logged {n} metrics")
            # MLflow 3.17 draws a page's charts a few at a time (headless, the first six, all in the comm section,
            # come in): the eval section's charts are counted against the run's eval/ metrics instead, and the
            # run's overview must list eval/accuracy with its value
            evals = sorted(k for k in run.data.metrics if k.startswith("eval/") and k.count("/") == 1)
            if "eval/accuracy" not in evals or sections.get("eval") != len(evals):
                failures.append(f"Model metrics tab: eval section of {sections.get('eval')} charts, the run logged "
                                f"{evals}")
            overview = page_text(browser, f"{base}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}"
                                 "?workflowType=machine_learning", OUT / "run_overview.png")
            if f"eval/accuracy {run.data.metrics['eval/accuracy']}"[:21] not in overview:
                (OUT / "run_overview.txt").write_text(overview)
                failures.append("run overview: eval/accuracy and its value not listed (text in run_overview.txt)")
        finally:
            server.terminate()
            server.wait(timeout=30)
    for f in failures:
        print(f"check-ui: {f}", file=sys.stderr)
    print(f"check-ui: {'FAILED' if failures else 'passed'}; screenshots in {OUT}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
