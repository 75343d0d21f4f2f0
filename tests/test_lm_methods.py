"""Methods on a language model (issue 71, item 5): the equivalences (SplitNN with one client is centralised training
of the same model on the same batches; SFLV1 with LoRA and one client is a plain ``peft`` LoRA loop), one round of
every newly enabled method with eval/perplexity, SplitLoRA's choices, and the refusals of the methods that need a
class label per sample, each naming the method and why before any actor starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import make_config, run_rounds
from raysplit.config import load_config
from raysplit.errors import ConfigError
from raysplit.experiment import run_experiment
from raysplit.metrics import WALL_CLOCK

# tiny: 2 blocks of width 32, four small fortune categories, 32-token blocks, a 300-token BPE
LM = {"data.dataset": "digits", "data.num_clients": 2, "data.partition.name": "natural", "data.test_fraction": 0.0,
      "data.text.corpus": "fortunes", "data.text.categories": ["goedel", "magic", "paradoxum", "riddles"],
      "data.text.context_length": 32, "data.text.test_fraction": 0.2, "data.text.tokenizer.vocab_size": 300,
      "model.cut": "block1", "model.lm.family": "gpt2", "model.lm.layers": 2, "model.lm.width": 32,
      "model.lm.heads": 2, "model.lm.max_positions": 32, "model.lm.adapter.rank": 4,
      "model.lm.adapter.target_modules": ["c_attn", "c_fc", "lm_head"],
      "train.batch_size": 8, "train.local_steps": 2, "train.rounds": 1, "train.optimizer.name": "adam",
      "train.optimizer.lr": 0.01, "eval.batch_size": 64, "runtime.backend": "local", "tracking.enabled": False}
ONE_CLIENT = {"data.num_clients": 1, "train.participation.count": 1, "train.rounds": 2}


def lm_config(tmp_path, mlflow_uri=None, **over):
    return make_config(tmp_path, mlflow_uri, **{**LM, **over})


def full_model_state(facts, client: dict, server: dict | None) -> dict:
    """The unsplit model's state (the library model's names) from a run's client and server states."""
    model = facts.build()
    if server is None:  # no cut: the client holds the whole model
        model.load_state_dict(client)
    elif facts.tail_cut is not None:
        head, middle, tail = model.split3(facts.cut, facts.tail_cut)
        torch.nn.ModuleDict({"head": head, "tail": tail}).load_state_dict(client)
        middle.load_state_dict(server)
    else:
        first, rest = model.split(facts.cut)
        first.load_state_dict(client)
        rest.load_state_dict(server)
    return {k: v.detach().clone() for k, v in model.hf_model.state_dict().items()}


def peft_reference(cfg, p):
    """The equivalence tests' reference: ``transformers``' GPT-2 under ``peft.get_peft_model``'s LoRA (the run's
    rank, alpha and targets, no dropout), holding the run's initial weights (``p``: its prepared inputs), with the
    unsplit initial state (the library model's names)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from raysplit.runtime import transport

    facts, lm, adapter = p.inputs.plan.model, cfg.model.lm, cfg.model.lm.adapter
    init = full_model_state(facts, transport.unpack_state(p.inputs.client_init),
                            transport.unpack_state(p.inputs.server_init))
    torch.manual_seed(123)  # the weights are loaded below: the seed only makes the test repeatable
    base = GPT2LMHeadModel(GPT2Config(vocab_size=facts.num_classes, n_positions=lm.max_positions, n_embd=lm.width,
                                      n_layer=lm.layers, n_head=lm.heads, n_inner=4 * lm.width, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    peft_model = get_peft_model(base, LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=0.0,
                                                 target_modules=list(adapter.target_modules), fan_in_fan_out=True,
                                                 bias="none"))
    peft_model.load_state_dict({"base_model.model." + k: v for k, v in init.items()})  # strict: every name
    return peft_model, init


def assert_states_close(got: dict, want: dict, init: dict | None = None, atol: float = 1e-6) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=atol, msg=k)
        if init is not None and "lora_" not in k:
            assert torch.equal(got[k], init[k]), k  # the frozen base did not move


# ---- the equivalences ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["u_shaped", "plain"])
def test_splitnn_with_one_client_equals_centralised_training_on_the_same_batches(tmp_path, split):
    """One client, batches of 8 from its cursor, Adam, LoRA: SplitNN (the model cut, the server's part on the server,
    U-shaped or plain) and ``centralised`` (one unsplit model, one optimizer) give the same model after 2 rounds of
    2 steps, to float rounding, and the same perplexity."""
    over = {**ONE_CLIENT, "model.lm.split": split}
    client, server, p, _ = run_rounds(lm_config(tmp_path / "a", **over, **{"algorithm.name": "splitnn"}))
    whole, _, q, _ = run_rounds(lm_config(tmp_path / "b", **over, **{"algorithm.name": "centralised"}))
    assert q.cut is None and p.cut is not None
    split_model = full_model_state(p.inputs.plan.model, client, server)
    central = full_model_state(q.inputs.plan.model, whole, None)
    from raysplit.runtime import transport

    init = full_model_state(q.inputs.plan.model, transport.unpack_state(q.inputs.client_init), None)
    assert_states_close(split_model, central, init)
    assert any(not torch.equal(central[k], init[k]) for k in central if "lora_B" in k)  # it trained


def test_sflv1_with_lora_and_one_client_equals_a_plain_peft_loop(tmp_path):
    """SFLV1 (U-shaped, one client, its batch the whole client: each step sees every block) with LoRA against a
    loop written here: ``transformers``' GPT-2 with ``peft.get_peft_model``'s LoRA (the same rank, alpha and
    targets), the same initial weights, the same batches, Adam over the adapters; the next-token loss written out.
    After 2 rounds of 2 steps the adapters agree to float rounding and the frozen base is untouched."""
    cfg = lm_config(tmp_path, **ONE_CLIENT, **{"algorithm.name": "sflv1", "train.batch_size": 4096})
    client, server, p, _ = run_rounds(cfg)
    facts = p.inputs.plan.model
    peft_model, init = peft_reference(cfg, p)
    trainable = [prm for prm in peft_model.parameters() if prm.requires_grad]
    opt = torch.optim.Adam(trainable, lr=cfg.train.optimizer.lr)
    x = torch.as_tensor(p.inputs.train_data["x"][p.inputs.train_idx[0]])
    for _ in range(cfg.train.rounds * cfg.train.local_steps):
        opt.zero_grad()
        logits = peft_model(input_ids=x).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
    loop = {k[len("base_model.model."):]: v.detach() for k, v in peft_model.state_dict().items()}
    got = full_model_state(facts, client, server)
    # the two compute the same sums in other orders (peft's forward against the split parts'); Adam divides each
    # step by the gradient's running scale, so an entry whose gradient is nearly zero carries that rounding into a
    # step of order lr: 3e-6 after 4 steps here, against updates of 2e-2 (plain SGD: 4e-9)
    assert_states_close(got, loop, init, atol=2e-5)
    assert any(not torch.equal(got[k], init[k]) for k in got if "lora_B" in k)


# ---- the newly enabled methods ------------------------------------------------------------------------------------
PLAIN = {"model.lm.split": "plain"}  # the server trains on pooled or concatenated batches with their tokens
ENABLED = {
    "sflv3": {},  # confident inference per next-token position
    "cyclesfl": PLAIN,  # per-sample mean token loss in the server's epochs
    "centralised": {},
    "fedbuff": {"train.participation.count": 2},  # asynchronous FL: the whole model on the clients
}
SLOW = {
    "cyclepsl": PLAIN, "cyclesglr": PLAIN, "sglr": PLAIN, "minibatch_sfl": PLAIN, "splitlora": {},
    "fedasync": {"train.participation.count": 1}, "ca2fl": {"train.participation.count": 2},
    "sflv3_plain": {"algorithm.name": "sflv3", **PLAIN},
    "sflv1_prox": PLAIN, "sflv1_scaffold": PLAIN, "pipar": PLAIN,  # SplitFed V1's variants (not built U-shaped)
    "splitlora_shared": {"algorithm.name": "splitlora", "algorithm.server_side": "shared", **PLAIN},
}


def one_round(tmp_path, method: str, over: dict) -> dict:
    over = {"algorithm.name": method, "data.test_fraction": 0.2, **over}
    return run_experiment(lm_config(tmp_path, **over))


@pytest.mark.parametrize("method", sorted(ENABLED))
def test_a_newly_enabled_method_runs_a_round_on_a_language_model(tmp_path, method):
    out = one_round(tmp_path, method, ENABLED[method])
    assert 1 < out["eval/perplexity"] < 1.5 * 300 and out["eval/tokens"] > 0, out
    assert "eval/accuracy" not in out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SLOW))
def test_more_methods_run_a_round_on_a_language_model(tmp_path, case):
    out = one_round(tmp_path, case, SLOW[case])
    assert 1 < out["eval/perplexity"] < 1.5 * 300 and out["eval/tokens"] > 0, out


def test_splitlora_with_interval_one_is_sflv1_and_with_two_aggregates_every_other_round(tmp_path):
    """SplitLoRA with I = 1 is SplitFed V1 (the same numbers, every round); with I = 2 no client-side adapters go
    up in round 0 and they do in round 1 (which ends the interval), and every round logs eval/perplexity."""
    def rounds_of(method: str, **over) -> list[dict]:
        got: list[dict] = []
        run_experiment(lm_config(tmp_path / f"{method}{over}", **{"algorithm.name": method, "train.rounds": 2,
                                                                   "data.test_fraction": 0.2, **over}),
                       on_round=lambda rnd, m: got.append(m))
        return got

    strip = lambda m: {k: v for k, v in m.items() if k not in WALL_CLOCK and k != "run_id"}  # noqa: E731
    every, sflv1 = rounds_of("splitlora"), rounds_of("sflv1")
    assert [strip(m) for m in every] == [strip(m) for m in sflv1]
    second = rounds_of("splitlora", **{"algorithm.aggregation_interval": 2})
    assert every[0]["comm/bytes_up_model"] > 0 and second[0]["comm/bytes_up_model"] == 0
    assert second[1]["comm/bytes_up_model"] == every[1]["comm/bytes_up_model"]
    assert all(m["eval/perplexity"] > 1 for m in every + second)
    assert second[1]["eval/perplexity"] != every[1]["eval/perplexity"]


def test_splitlora_lists_its_parameters_and_refuses_a_model_without_lora(tmp_path, capsys):
    from raysplit.cli import main

    assert main(["list", "splitlora"]) == 0
    out = capsys.readouterr().out
    assert "aggregation_interval" in out and "server_side" in out and "shared" in out
    with pytest.raises(ConfigError, match=r"algorithm=splitlora fine-tunes LoRA adapters of a language model"):
        make_config(tmp_path, None, **{"algorithm.name": "splitlora"})  # the digits CNN
    with pytest.raises(ConfigError, match=r"model\.lm\.adapter\.kind=lora \(got 'full'\)"):
        lm_config(tmp_path, **{"algorithm.name": "splitlora", "model.lm.adapter.kind": "full"})


@pytest.mark.slow  # the shipped size's BPE and model (test_config validates the file in the fast tier)
def test_the_splitlora_config_runs_a_round():
    """configs/llm/splitlora.yaml as shipped, one round of one step per client."""
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "llm" / "splitlora.yaml",
                      {"train.rounds": 1, "train.local_steps": 1, "runtime.backend": "local",
                       "tracking.enabled": False, "tracking.progress": False})
    assert cfg.algorithm_name == "splitlora" and cfg.model.lm.split == "plain"
    final = run_experiment(cfg)
    assert 1 < final["eval/perplexity"] < 1.5 * 512 and final["comm/bytes_up_model"] > 0


@pytest.mark.slow
def test_centralised_and_splitlora_through_ray_equal_the_local_backend(ray_session, tmp_path):
    """The rule calls (centralised's model handed between client hosts, SplitLoRA's per-client adapters between
    aggregations) give the local backend's numbers over Ray, bit for bit."""
    for method, over in (("centralised", {}), ("splitlora", {"algorithm.aggregation_interval": 2})):
        over = {"algorithm.name": method, "train.rounds": 2, "data.test_fraction": 0.2, "runtime.num_workers": 2,
                **over}
        local = run_experiment(lm_config(tmp_path / method / "a", **over))
        ray_run = run_experiment(lm_config(tmp_path / method / "b", **over, **{"runtime.backend": "ray"}))
        strip = lambda m: {k: "nan" if v != v else v for k, v in m.items()  # noqa: E731 - no gradients sent: NaN
                           if k not in WALL_CLOCK and k != "run_id"}
        assert strip(ray_run) == strip(local), method


# ---- refusals -------------------------------------------------------------------------------------------------
REFUSED = {
    "gas": "needs a class label per sample", "hydra": "needs a class label per sample",
    "multihead": "needs a class label per sample", "mergesfl": "needs a class label per sample",
    "s2fl": "balances its client groups by their label counts", "semisfl": "needs a class label per sample",
    "semifl": "needs a class label per sample", "fedswitch_sl": "needs a class label per sample",
    "supervised_only": "needs a class label per sample", "splitgp": "local head is a classifier",
    "ampere": "trains a classifier head",
}


@pytest.mark.parametrize("method", sorted(REFUSED))
def test_a_method_that_needs_class_labels_is_refused_before_any_actor_starts(tmp_path, monkeypatch, method):
    import raysplit.experiment as experiment

    def no_actors(*a, **k):
        raise AssertionError("an actor was about to start")

    monkeypatch.setattr(experiment, "make_backend", no_actors)
    monkeypatch.setattr(experiment, "runtime_for", no_actors)
    labelled = {"data.n_labeled": 10} if method in ("semisfl", "semifl", "fedswitch_sl", "supervised_only") else {}
    if method == "ampere":
        labelled = {"data.test_fraction": 0.2}  # its config check asks for validation splits first
    cfg = lm_config(tmp_path, **{"algorithm.name": method, **labelled})
    with pytest.raises(ConfigError, match=rf"^algorithm={method} cannot train a language model \(model\.lm\): "
                                          rf"{method}.*{REFUSED[method]}"):
        run_experiment(cfg)


@pytest.mark.parametrize("method", ["cyclepsl", "cyclesfl", "cyclesglr", "minibatch_sfl", "sglr"])
def test_a_pooled_method_u_shaped_says_to_send_the_text(tmp_path, method):
    """The U-shape keeps the targets on the clients; a server that trains on pooled batches needs them."""
    with pytest.raises(ConfigError, match=rf"model\.lm\.split=u_shaped .*: {method}'s server pools every client's "
                                          r"features.*; set model\.lm\.split=plain to send the text to the server"):
        run_experiment(lm_config(tmp_path, **{"algorithm.name": method}))
