"""Clients with their own cuts on a language model (issue 72 with issue 71's models): two tiers of a tiny U-shaped
GPT-2 with LoRA run end to end with a perplexity per tier; each client's FLOPs and bytes come from its own cut and
LoRA rank; adapters of different ranks aggregate zero-padded, each rank component over its holders (hand-made
weights); a bad tier on a language model is one error naming the key, before any actor."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import run_rounds
from test_lm_runs import lm_config

from raysplit import experiment
from raysplit.errors import ConfigError
from raysplit.models.tiers import at_rank, fit_state
from raysplit.runtime import tiered, transport

# a 3-block LM (embed, block1..block3, head): the clients cut at block1 or block2, the server holds block2, block3
TIERS = {"model.cut": None, "model.lm.layers": 3, "data.num_clients": 4, "algorithm.name": "sflv1",
         "model.tiers": [{"cut": "block1", "clients": [0, 1], "rank": 2}, {"cut": "block2", "clients": [2, 3]}],
         "runtime.backend": "local", "tracking.enabled": False, "train.rounds": 2}


def test_two_tiers_on_a_language_model_run_end_to_end_with_a_perplexity_per_tier(tmp_path):
    final = experiment.run_experiment(lm_config(tmp_path, None, **TIERS, **{"data.test_fraction": 0.2,
                                                                          "eval.mode": "clients",
                                                                          "eval.clients": "all"}))
    for key in ("eval/perplexity", "eval/tier0/perplexity", "eval/tier1/perplexity"):
        assert 1 < final[key] < 300 * 1.5, key  # below about the vocabulary's size: it learned something
    assert final["eval/tier0/loss"] == pytest.approx(math.log(final["eval/tier0/perplexity"]))
    assert "eval/tier0/accuracy" not in final and final["eval/tier1/next_token_accuracy"] > 0
    assert final["compute/tier0/client_flops"] < final["compute/tier1/client_flops"]  # one block fewer
    assert final["comm/tier0/bytes_up"] < final["comm/tier1/bytes_up"]


def test_each_client_counts_bytes_from_its_own_cut_and_rank_and_ranks_aggregate_at_the_largest(tmp_path):
    """SFLV1, two rounds: a client's model upload is its own part (its blocks at its rank: block1 at rank 2 for
    clients 0-1, block1-block2 at rank 4 for clients 2-3, each with the tail); the aggregate holds block1's
    adapters at rank 4, whose components 2-3 only clients 2-3 trained, and the server's block2 at its rank."""
    client, server, p, stats = run_rounds(lm_config(tmp_path, None, **TIERS))
    facts = p.inputs.plan.model
    assert facts.cuts == (2, 2, 3, 3) and facts.ranks == (2, 2, 4, 4) and facts.widest_rank == 4
    rows = stats[-1].clients
    for cid in range(4):
        part = facts.part_at(facts.cut_of(cid))
        assert rows[cid]["bytes_up_model"] == transport.state_nbytes(part.state_dict())
        lora_a = [v for k, v in part.state_dict().items() if "lora_A" in k]
        assert lora_a and all(v.shape[0] == facts.rank_of(cid) for v in lora_a)
    assert rows[0]["bytes_up_model"] < rows[2]["bytes_up_model"] and rows[0]["flops"] < rows[2]["flops"]
    a1 = client["head.1.layer.attn.c_attn.lora_A.default.weight"]
    assert a1.shape[0] == 4  # block1 at the largest rank
    shallow = at_rank(client, 2)["head.1.layer.attn.c_attn.lora_A.default.weight"]
    assert shallow.shape[0] == 2 and torch.equal(shallow, a1[:2])
    assert server["2.layer.attn.c_attn.lora_A.default.weight"].shape[0] == 4  # the server at model.lm's rank
    # the server's block2 is the aggregate's (the server a holder of the overlap)
    assert torch.equal(server["2.layer.attn.c_attn.lora_B.default.weight"],
                       client["head.2.layer.attn.c_attn.lora_B.default.weight"])


def test_adapters_of_different_ranks_aggregate_zero_padded_on_hand_made_weights():
    """Client A (weight 1) holds block 1 at rank 1, client B (weight 3) blocks 1-2 at rank 2, the server block 2
    at rank 1 (for A, which cuts before it). Block 1: component 0 is (1*1 + 3*5)/4, component 1 B's alone (2);
    block 2: component 0 (3*6 + 1*10)/4 with the server, component 1 B's alone (7); the server gets its rank's
    part. The same whether one worker sums both clients or each its own."""
    t = torch.tensor
    a = {"1.lora_A.w": t([[1.0, 1.0]]), "1.lora_B.w": t([[1.0], [1.0]])}
    b = {"1.lora_A.w": t([[5.0, 5.0], [2.0, 2.0]]), "1.lora_B.w": t([[5.0, 2.0], [5.0, 2.0]]),
         "2.lora_A.w": t([[6.0, 6.0], [7.0, 7.0]])}
    server = {"2.lora_A.w": t([[10.0, 10.0]]), "3.w": t(1.0)}
    like = {k: torch.zeros(v.shape) for k, v in b.items()}
    want_1a, want_1b = t([[4.0, 4.0], [2.0, 2.0]]), t([[4.0, 2.0], [4.0, 2.0]])
    want_2a = t([[7.0, 7.0], [7.0, 7.0]])
    for partials in ([tiered.partial_sum([a], [1.0]), tiered.partial_sum([b], [3.0])],
                     [tiered.partial_sum([a, b], [1.0, 3.0])], [tiered.partial_sum([b, a], [3.0, 1.0])]):
        packed = [({k: v.numpy() for k, v in s.items()}, h) for s, h in partials]
        state, update = tiered.finish(packed, 4.0, server, like)
        assert torch.equal(state["1.lora_A.w"], want_1a) and torch.equal(state["1.lora_B.w"], want_1b)
        assert torch.equal(state["2.lora_A.w"], want_2a)
        assert set(update) == {"2.lora_A.w"} and torch.equal(update["2.lora_A.w"], t([[7.0, 7.0]]))
    # each client keeps its own rank's components of the aggregate
    assert torch.equal(fit_state(state, a)["1.lora_A.w"], t([[4.0, 4.0]]))
    assert torch.equal(at_rank(state, 1)["1.lora_B.w"], t([[4.0], [4.0]]))
    with pytest.raises(ValueError, match="has shape"):
        fit_state(a, b)  # a rank-1 state cannot fill a rank-2 part


@pytest.mark.parametrize("tiers, words", [
    ([{"cut": "block1", "share": 0.5}, {"cut": "block7", "share": 0.5}], "model.tiers[1].cut: invalid cut"),
    ([{"cut": "block1", "share": 0.5}, {"cut": "block3", "share": 0.5}],
     "model.tiers[1].cut='block3': leaves the server no decoder block before the head"),
    ([{"cut": "embed", "share": 0.5}, {"cut": "block1", "share": 0.5}], "model.tiers[0].cut='embed': the client's "
                                                                         "blocks (embed) train nothing"),
    ([{"cut": "block1", "share": 0.5, "rank": 0}, {"cut": "block2", "share": 0.5}], "model.tiers.0.rank"),
    ([{"cut": "block1", "clients": [0], "rank": 2}, {"cut": "block1", "clients": [1, 2], "rank": 3},
      {"cut": "block2", "clients": [3]}], "model.tiers[1].rank=3: model.tiers[0] has the same cut"),
    ({"seconds": 1.0, "cuts": ["block1", "block3"]}, "model.cut_budget.cuts: 'block3' leaves the server no decoder"),
])
def test_a_bad_tier_on_a_language_model_is_one_error_naming_the_key(tmp_path, monkeypatch, tiers, words):
    def no_actor(*a, **kw):
        raise AssertionError("an actor was asked for")

    monkeypatch.setattr(experiment, "runtime_for", no_actor)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        over = {"model.tiers": tiers} if isinstance(tiers, list) else {"model.tiers": None, "model.cut_budget": tiers}
        experiment.run_experiment(lm_config(tmp_path, None, **{**TIERS, **over}))


def test_a_rank_needs_lora_adapters(tmp_path, monkeypatch):
    from helpers import make_config

    with pytest.raises(ConfigError, match=r"model.tiers\[0\].rank: a rank is a LoRA adapter's"):
        experiment.prepare(make_config(tmp_path, None, **{"runtime.backend": "local", "model.cut": None,
                                                          "model.tiers": [{"cut": "conv1", "share": 0.5, "rank": 2},
                                                                          {"cut": "conv2", "share": 0.5}]}))


@pytest.mark.parametrize("over, ranks", [({}, None),
                                         ({"model.tiers": [{"cut": "block1", "share": 0.5, "rank": 2},
                                                           {"cut": "block3", "share": 0.5}]}, {2: 2, 4: 4})])
def test_the_documented_language_model_config_prepares_its_tiers(over, ranks):
    """configs/tiers/llm.yaml (docs/usage.md, docs/results/tiers.md) as it is and with the rank its comment gives:
    the faster half of the 8 clients at block3, the others at block1, the server from block2 on."""
    from pathlib import Path

    from raysplit.config import load_config

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiers" / "llm.yaml",
                      {"runtime.backend": "local", "tracking.enabled": False, **over})
    p = experiment.prepare(cfg)
    facts = p.inputs.plan.model
    assert {c: facts.cuts.count(c) for c in set(facts.cuts)} == {2: 4, 4: 4} and facts.cut == 2
    speeds = [q.flops for q in p.inputs.profiles]
    assert min(speeds[c] for c in range(8) if facts.cuts[c] == 4) >= max(speeds[c] for c in range(8)
                                                                          if facts.cuts[c] == 2)
    assert p.cut_name == "block1:4,block3:4"
    assert (facts.ranks is None) == (ranks is None)
    if ranks is not None:
        assert all(facts.rank_of(c) == ranks[facts.cuts[c]] for c in range(8))
