"""Placement on a simulated multi-node cluster (ray.cluster_utils.Cluster): the actors land on the nodes that offer
their resources, and losing the client actors' node is a clear error. Read from tests/node_loss_script.py's cluster
(the ``node_loss`` fixture, tests/conftest.py), which also serves tests/test_faults.py's node-loss tests: one
cluster for both (issue 51; this test started a second one before)."""

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.subprocess]


@pytest.mark.slow
def test_actors_land_on_their_nodes_and_node_loss_is_a_clear_error(node_loss):
    placed = node_loss["placement"]
    assert placed["server"] == [node_loss["server_node"]], placed  # the only node offering `server`
    assert placed["workers"] == [node_loss["node_a"]], placed  # the only node offering `client`
    # losing the client node (crashed, no node left that offers `client`) is reported as the death of a client actor
    # naming its node, well before any timeout (Ray's own words differ by how the node went: "its node has died"
    # when it was removed gracefully, a reset connection when it crashed, as here)
    got = node_loss["noroom"]
    first, lost = got["first_error"] or "", got["nodes_before"][0]
    assert first.startswith("ActorFailure: client actor") and f"on node {lost}" in first and " died " in first, got
    assert got["seconds_removal_to_error"] < 50, got
