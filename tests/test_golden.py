"""Golden fingerprints (scripts/golden.py, `make golden`): every algorithm that `raysplit list` shows reruns its tiny
deterministic run end to end (local backend) and must give the per-round metrics stored in tests/golden/. A failure
names the algorithm, the metric, the round, what was stored and what came out. An intended change of a method's
behaviour rewrites its file with `make golden`, says why in the commit and reruns that method's result pages."""

from __future__ import annotations

import copy

import pytest
from helpers import counting_syncs, load_script

from raysplit.algorithms import ALGORITHMS

golden = load_script("golden")


def test_every_listed_algorithm_has_a_fingerprint_and_no_other_is_stored():
    stored = {p.stem for p in golden.GOLDEN.glob("*.json")}
    listed = set(golden.algorithms())  # every algorithm and the privacy plug-ins' runs
    assert sorted(stored) == sorted(listed), (
        f"missing: {sorted(listed - stored)} (run `make golden`); stale: {sorted(stored - listed)}")


# Host synchronisations a training step may make (issue 70): a call that waits for a tensor's device (item, cpu,
# numpy, tolist, float, int, bool, __array__ on a tensor), counted by helpers.counting_syncs within the steps of the
# golden run (local backend, one process: hosts hand each other tensors, the losses, norms and NaN/inf screens stay
# on the device until the round's end). None for every method but these, each bounded per client step and why:
SYNC_BUDGET = {
    # the contrastive loss's feature queue is host memory (a snapshot's keeper holds no GPU): each cross-entity step
    # (every client's two streams at once) pushes the batch's keys, labels and masks there: 3 a pooled step
    "semisfl": (1, "the feature queue's push (keys, labels, masks) to host memory, 3 a pooled step"),
    # SGLR shares its gradient in host memory in float64, as the authors' code does, and takes the norms there
    "sglr": (2, "SGLR's shared gradient and the gradients' norms in host memory (float64)"),
    "cyclesglr": (2, "SGLR's shared gradient and the gradients' norms in host memory (float64)"),
    # GAS's flush keeps its per-label feature statistics in numpy (features and labels of the flushed buffer)
    "gas": (2, "GAS's flush: the buffer's features and labels into its numpy statistics"),
    "privacy_quantize": (2, "GAS's flush (privacy_quantize runs on GAS)"),
    "privacy_inversion": (2, "GAS's flush (privacy_inversion runs on GAS)"),
    # a language model's decoder block builds its causal mask with transformers' create_causal_mask, which reads
    # whether the (all-ones) attention mask has padding: one __bool__ per block forward, 2 a step of 2 blocks
    "splitlora": (3, "transformers' causal-mask builder reads the attention mask once per decoder block"),
}


@pytest.mark.parametrize("name", golden.algorithms())
def test_algorithm_reproduces_its_golden_fingerprint(name):
    """The stored numbers, and within the run's steps no host synchronisation past the method's budget
    (:data:`SYNC_BUDGET`; none for the synchronous families)."""
    expected = golden.load(name)
    assert expected["overrides"] == golden.overrides(name), (
        f"{name}: tests/golden/{name}.json was made with other settings than scripts/golden.py now uses "
        "(run `make golden`)")
    with counting_syncs() as syncs:
        got = golden.run(name)
    assert len(got["rounds"]) == expected["overrides"]["train.rounds"] and all(
        "eval/accuracy" in r or "eval/perplexity" in r for r in got["rounds"]), got["rounds"]  # a language model's
    diff = golden.differences(expected, got)
    assert not diff, (f"{name}'s behaviour changed ({len(diff)} metric(s) x rounds differ; if intended, run "
                      "`make golden`, say why in the commit and rerun its results pages):\n  " + "\n  ".join(diff[:12]))
    budget, why = SYNC_BUDGET.get(name, (0, "none"))
    assert syncs.per_step() <= budget, (
        f"{name}: {syncs.total} host synchronisations in {syncs.steps} client steps ({syncs.per_step():.2f} a step, "
        f"budget {budget}: {why}): {syncs.where()}")


RAY = {"runtime.backend": "ray", "runtime.server.num_cpus": 0.5, "runtime.client.num_cpus": 0.5,
       "runtime.keep_actors_s": 30}  # a run's actors serve the next (helpers.make_config)
# one algorithm per loop family: split steps (server-driven), pooled steps, the event loop
FAMILIES = {"split": "sflv2", "pooled": "cyclesfl", "events": "gas"}


@pytest.mark.smoke
@pytest.mark.parametrize("transport", ["compiled", "calls"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_loop_family_through_ray_reproduces_its_fingerprint(ray_session, family, transport):
    """The fast tier's runs through Ray: one per loop family on each transport, two client actors, held to the
    local backend's stored numbers."""
    name = FAMILIES[family]
    got = golden.run(name, **RAY, **{"runtime.transport.kind": transport, "runtime.num_workers": 2})
    diff = golden.differences(golden.load(name), got)
    assert not diff, f"{name} through Ray ({transport}) differs from its fingerprint:\n  " + "\n  ".join(diff[:12])


def ray_representatives() -> list[str]:
    """What the Ray backend can change is how hosts run in actors and how the runtime's paths are driven, not what an
    algorithm's driver-side code decides: one algorithm per (client rule, server host, driver) triple, less what
    runs through Ray elsewhere: every round-based algorithm (tests/test_direct_steps.py holds each one's golden run
    on a Ray path to the local backend's, bit for bit) and the loop families the fast tier runs here. What is left
    are the asynchronous methods' own triples."""
    from raysplit.algorithms import AsyncAlgorithm

    seen, out = set(), []
    first = [*FAMILIES.values()]  # a triple's best-known member stands for it
    for name in first + sorted(set(ALGORITHMS) - set(first)):
        alg = ALGORITHMS[name]
        triple = (alg.client_rule, alg.server_rule, alg.driver)
        if triple not in seen:
            seen.add(triple)
            out.append(name)
    return sorted(n for n in set(out) - set(FAMILIES.values()) if issubclass(ALGORITHMS[n], AsyncAlgorithm))


@pytest.mark.parametrize("name", ray_representatives())
def test_every_host_and_path_through_ray_actors_reproduces_its_fingerprint(ray_session, name):
    """Each algorithm's hosts in Ray actors (one client actor, actor calls) give the local backend's numbers."""
    got = golden.run(name, **RAY, **{"runtime.transport.kind": "calls", "runtime.num_workers": 1})
    diff = golden.differences(golden.load(name), got)
    assert not diff, f"{name} through Ray differs from its fingerprint:\n  " + "\n  ".join(diff[:12])


def test_a_difference_is_named_by_algorithm_metric_and_round():
    rec = golden.load("sflv2")
    other = copy.deepcopy(rec)
    other["rounds"][1]["eval/loss"] *= 1.01  # a change far smaller than any changed step gives
    assert golden.differences(rec, other) == [
        f"sflv2: eval/loss at round 1: expected {rec['rounds'][1]['eval/loss']!r}, "
        f"got {other['rounds'][1]['eval/loss']!r}"]
    other["rounds"][2]["eval/loss"] = rec["rounds"][2]["eval/loss"] * (1 + golden.REL_TOL / 10)  # last-bit noise: ok
    assert len(golden.differences(rec, other)) == 1
    del other["rounds"][2]
    assert "2 rounds, expected 3" in golden.differences(rec, other)[0]


def test_an_attacks_reconstruction_scores_have_their_own_tolerance():
    """privacy/mse, psnr and ssim (the end of the attack's optimisation) may move by the 0.2-0.6 % another CPU's
    vector units give (scripts/golden.py, RECONSTRUCTION); 2 % is a difference, and so is 0.6 % of any other
    metric, the attack's distance correlation included."""
    rec = golden.load("privacy_inversion")
    other = copy.deepcopy(rec)
    for k in golden.RECONSTRUCTION:
        other["rounds"][2][k] *= 1.006
    assert golden.differences(rec, other) == []
    other["rounds"][2]["privacy/mse"] = rec["rounds"][2]["privacy/mse"] * 1.02
    other["rounds"][1]["privacy/dcor"] *= 1.006
    other["rounds"][1]["eval/loss"] *= 1.006
    assert [d.split(":")[1] for d in golden.differences(rec, other)] == [
        " eval/loss at round 1", " privacy/dcor at round 1", " privacy/mse at round 2"]


def test_fingerprint_is_a_digest_of_the_stored_rounds(tmp_path, monkeypatch):
    (tmp_path / "sflv2.json").write_text(golden.path("sflv2").read_text())
    monkeypatch.setattr(golden, "GOLDEN", tmp_path)
    before = golden.fingerprint("sflv2")
    edited = golden.load("sflv2")
    edited["rounds"][0]["eval/accuracy"] += 0.01
    golden.write(edited)
    assert golden.fingerprint("sflv2") != before and len(before) == 12


@pytest.mark.parametrize("name", sorted(golden.PLUGINS))
def test_privacy_plugins_through_ray_actors_reproduce_their_fingerprints(ray_session, name):
    """The defences and the attack in Ray actors (two client actors, compiled channels): the local numbers, so the
    privacy spec (with its auxiliary images) reaches every host and the event loop's cost model matches."""
    got = golden.run(name, **RAY, **{"runtime.transport.kind": "compiled", "runtime.num_workers": 2})
    diff = golden.differences(golden.load(name), got)
    assert not diff, f"{name} through Ray differs from its fingerprint:\n  " + "\n  ".join(diff[:12])
