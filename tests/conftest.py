"""Fixtures and the test tiers (helpers the tests share are in helpers.py).

Tiers: ``pytest`` (``bash scripts/test.sh``) runs the fast tier: every unit and semantic test, every algorithm end to
end on the local backend (tests/test_golden.py), and the tests marked ``smoke`` (one run through Ray per loop family
on each transport). ``pytest --all`` (``bash scripts/test.sh --all``, what CI runs) adds every test marked with one
of FULL_TIER: in-process Ray (``ray``, set automatically on every test that uses the ``ray_session`` fixture),
multi-node clusters, real MLflow servers, fault injection, subprocesses and heavy runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import write_fake_fashion_mnist

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

FULL_TIER = ("ray", "cluster", "mlflow_server", "faults", "subprocess", "slow")


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", default=False,
                     help=f"run the full tier too (tests marked {', '.join(FULL_TIER)}), not only the fast tier")
    parser.addoption("--full-only", action="store_true", default=False,
                     help="only what the full tier adds to the fast tier (CI runs the fast tier, then this, to time "
                          "each tier on its own)")
    parser.addoption("--matrix", action="store_true", default=False,
                     help="run the whole fault matrix too (tests marked matrix; make fault-matrix), not only the "
                          "cases CI runs")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    full_only = config.getoption("--full-only")
    full_tier, matrix = config.getoption("--all") or full_only, config.getoption("--matrix")
    keep, drop = [], []
    for item in items:
        fast = not any(item.get_closest_marker(m) for m in FULL_TIER) or bool(item.get_closest_marker("smoke"))
        if item.get_closest_marker("matrix"):
            out = not matrix
        else:
            out = (not full_tier and not fast) or (full_only and fast)
        (drop if out else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config):
    return ("tier: what the full tier adds (--full-only)" if config.getoption("--full-only") else
            "tier: full (--all)" if config.getoption("--all") else
            f"tier: fast (tests marked {', '.join(FULL_TIER)} deselected unless also smoke; --all runs them)")


@pytest.fixture(scope="session", autouse=True)
def scratch_working_directory(tmp_path_factory):
    """Tests run in a scratch directory: what a run writes relative to the working directory (MLflow's default
    artifact root ./mlruns beside a sqlite store, outputs/) never lands in the repository. Tests that need the
    repository pass it as a path (or as ``cwd`` to a subprocess)."""
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(here)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session, sized from the machine (logical CPUs = its cores, at least 2)."""
    import ray

    if not ray.is_initialized():
        # address="local": a fresh instance even when another Ray runs on this machine (a test's head or cluster
        # that outlived it would otherwise be joined, and num_cpus refused)
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), object_store_memory=512 * 1024**2,
                 include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="session")
def fmnist_root(tmp_path_factory):
    """Small fake Fashion-MNIST in the real IDX format (helpers.write_fake_fashion_mnist)."""
    root = tmp_path_factory.mktemp("fmnist")
    write_fake_fashion_mnist(root)
    return root


@pytest.fixture(scope="session")
def node_loss(tmp_path_factory):
    """tests/node_loss_script.py in its own process (its own ray.cluster_utils.Cluster): one reference run (in
    process), the client actors' node removed gracefully (SIGTERM) and then as a crash (SIGKILL, Ray learns of it
    from its health checks) with a spare node each time, then removed with no node left that offers their resource;
    where the actors were placed. One cluster for tests/test_faults.py and tests/test_placement.py."""
    here = Path(__file__).resolve().parent
    work = tmp_path_factory.mktemp("node-loss")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(here.parent))
    proc = subprocess.run([sys.executable, str(here / "node_loss_script.py"), str(work)], capture_output=True,
                          text=True, timeout=400, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result; rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert "watchdog" not in out, f"the script ran past its watchdog: {out}\n{proc.stderr[-3000:]}"
    return out
