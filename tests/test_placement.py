"""Placement on a simulated multi-node cluster (ray.cluster_utils.Cluster), in a separate process so it does not
share the test session's Ray."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.subprocess]

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_actors_land_on_their_nodes_and_node_loss_is_a_clear_error():
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(HERE.parent))
    proc = subprocess.run([sys.executable, str(HERE / "multinode_script.py")], capture_output=True, text=True,
                          timeout=240, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result; rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["server_on_server_node"] and out["workers_on_client_node"] and out["round0_ok"], out
    # losing the client node ends the run with an error naming an actor death, well before any timeout
    assert out["error"] is not None and "ActorFailure" in out["error"], out
    assert "client actor" in out["error"] and "node has died" in out["error"], out
    assert out["seconds_to_error"] < 50, out
