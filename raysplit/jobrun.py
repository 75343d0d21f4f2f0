"""What ``jobs/train.py`` runs on a cluster: the ``raysplit run`` command line of a Ray job.

A job (``ray job submit ... -- python jobs/train.py CONFIG [key=value ...]``) differs from a run on one's own
machine in three ways, decided here:

- it joins the cluster it was submitted to (``runtime.address=auto``) instead of starting a Ray of its own;
- its MLflow run must land in a store the user can read: a job with no tracking URI, or with a sqlite/file store
  given by a relative path (which would live in the job's temporary working directory on the head node and be
  deleted with the Ray session), is refused before anything starts, with the way to set one; its checkpoints go
  to ``~/raysplit/outputs`` on the node running the job's driver unless ``tracking.output_dir`` is absolute;
- a job resubmitted with the same run name (``tracking.run_name``, default the config's ``name``) whose earlier
  run did not finish (RUNNING: its driver was killed; KILLED: the job was stopped; FAILED) and left a checkpoint
  continues that run
  (``raysplit run --resume``), so a job retried by the cluster does not start over. It checkpoints every
  ``JOB_CHECKPOINT_EVERY`` rounds unless ``tracking.checkpoint_every`` is set.
"""

from __future__ import annotations

import os
from pathlib import Path

from raysplit.errors import ConfigError
from raysplit import tags

JOB_CHECKPOINT_EVERY = 5


def store_problem(uri: str | None) -> str:
    """Why a job cannot track to ``uri`` ('' when it can)."""
    how = ("set tracking.uri=http://MLFLOW_HOST:5000 (an `mlflow server` every node and you can reach; README: "
           "'Submitting a job') or MLFLOW_TRACKING_URI in the job's runtime env (env_vars)")
    if not uri:
        return f"no MLflow tracking store is set: the run would go to a sqlite file in the job's temporary working " \
               f"directory on the head node, where you cannot see it and which is deleted with the session; {how}"
    for scheme in ("sqlite:///", "file:"):
        if uri.startswith(scheme):
            path = uri[len(scheme):]
            if scheme == "file:":
                path = path.removeprefix("//")
            if not path.startswith("/"):
                return f"tracking.uri={uri!r} is a relative path: it would be inside the job's temporary working " \
                       f"directory on the head node and be deleted with the session; {how} (or give an absolute path)"
    if ":" not in uri and not uri.startswith("/") and uri != "databricks":  # a bare local path
        return f"tracking.uri={uri!r} is a relative path; {how}"
    return ""


def _resumable(uri: str, experiment: str, run_name: str) -> tuple[str, str] | None:
    """(run id, status) of the latest run named ``run_name`` that did not finish and left a checkpoint file."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    name = run_name.replace("'", "\\'")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{name}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs or runs[0].info.status not in ("RUNNING", "FAILED", "KILLED"):
        return None
    ckpt = runs[0].data.tags.get(tags.CHECKPOINT)
    if not ckpt or not Path(ckpt).is_file():
        return None
    return runs[0].info.run_id, runs[0].info.status


def job_argv(args: list[str], env: dict | None = None) -> tuple[list[str], str]:
    """``raysplit`` argv for a job's ``jobs/train.py`` arguments, and a line saying what the job does."""
    from raysplit.config import load_config
    from raysplit.tracking import resolve_uri

    env = os.environ if env is None else env
    if "--resume" in args:
        return ["run", *args], "resuming the given run"
    if not args or "=" in args[0]:
        raise ConfigError("jobs/train.py: give a CONFIG file first, then key=value overrides")
    config, overrides = args[0], list(args[1:])
    given = {o.split("=", 1)[0] for o in overrides}
    if "runtime.address" not in given:
        overrides.append("runtime.address=auto")
    cfg = load_config(config, overrides)
    uri = cfg.tracking.uri or env.get("MLFLOW_TRACKING_URI")
    problem = store_problem(uri)
    if problem:
        raise ConfigError(f"refusing to start the job: {problem}")
    uri = resolve_uri(uri)
    if not Path(cfg.tracking.output_dir).is_absolute():
        overrides.append(f"tracking.output_dir={Path.home() / 'raysplit' / 'outputs'}")
    if "tracking.checkpoint_every" not in given and cfg.tracking.checkpoint_every == 0:
        overrides.append(f"tracking.checkpoint_every={JOB_CHECKPOINT_EVERY}")
    run_name = cfg.tracking.run_name or cfg.name
    found = _resumable(uri, cfg.tracking.experiment, run_name)
    if found:
        run_id, status = found
        return (["run", "--resume", run_id, config, f"tracking.uri={uri}"],
                f"resuming run {run_id} ({run_name!r}, {status}) from its last checkpoint")
    return ["run", config, *overrides], f"new run {run_name!r} tracked at {uri}"
