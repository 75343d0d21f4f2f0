"""configs/llm/ (issue 71, item 9) and the first equivalence of its Evidence.

Every config in configs/llm/ runs one round: the named settings (quickstart, sflv1, psl, splitnn) as shipped, cut to
one step a client; the paper-scale ones (SplitLoRA's GPT-2 S on E2E, a Llama from a local directory) on fake files:
a tiny random GPT-2 / Llama saved with ``save_pretrained`` beside a BPE ``tokenizer.json``, and fake JSON-lines
text, their sizes overridden so that a round takes seconds on the CPU, with every internet socket refused (a
pretrained directory loads local only). SFLV1 with LoRA and one client trains what a plain ``peft`` LoRA loop
trains on the same batches with the same optimizer."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import make_config, run_rounds
from raysplit.config import load_config
from raysplit.experiment import run_experiment

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "llm"
ONE_ROUND = {"train.rounds": 1, "train.local_steps": 1, "runtime.backend": "local", "tracking.enabled": False,
             "tracking.progress": False}


def test_every_config_in_configs_llm_is_run_here():
    """A config added to configs/llm/ needs its one-round run below."""
    # splitlora.yaml: tests/test_lm_methods.py
    assert {p.name for p in CONFIGS.glob("*.yaml")} == (set(NAMED) | set(PAPER_SCALE)
                                                        | {"splitlora.yaml", "families.yaml"})


def test_the_studys_base_config_runs_a_round_with_its_held_out_splits():
    """configs/llm/families.yaml (docs/results/llm.md's base): every arm holds out 10 % of each client's blocks, so
    PSL, whose clients keep their own models, evaluates on them (eval.mode clients needs them) and the methods with
    a global model on the held-out text."""
    small = {**ONE_ROUND, "data.text.categories": ["goedel", "magic", "riddles"], "data.num_clients": 3,
             "data.text.tokenizer.vocab_size": 300}
    for name in ("sflv1", "psl"):
        cfg = load_config(CONFIGS / "families.yaml", {**small, "algorithm.name": name})
        assert cfg.data.test_fraction == 0.1
        final = run_experiment(cfg)
        assert 1 < final["eval/perplexity"] < 1.5 * 300 and final["eval/tokens"] > 0, name


NAMED = ["quickstart.yaml", "sflv1.yaml", "psl.yaml", "splitnn.yaml"]


@pytest.mark.parametrize("name", NAMED[1:])  # quickstart.yaml: tests/test_lm_runs.py
def test_a_named_setting_runs_a_round(name):
    cfg = load_config(CONFIGS / name, {**ONE_ROUND, "data.text.categories": ["goedel", "magic", "riddles"],
                                       "data.num_clients": 3, "data.text.tokenizer.vocab_size": 300})
    assert cfg.algorithm.name == name.removesuffix(".yaml")
    final = run_experiment(cfg)
    assert 1 < final["eval/perplexity"] < 1.5 * 300 and final["eval/tokens"] > 100
    assert final["comm/bytes_down_middle"] > 0  # U-shaped: the middle's output comes back to the client's head


# ----------------------------------------------------------------------------------------------------------------
# Paper-scale configs on fake files
# ----------------------------------------------------------------------------------------------------------------
E2E_LIKE = ["name[{n}], eatType[{t}], food[{f}], area[{a}] || {n} is a {t} serving {f} food in the {a}.",
            "name[{n}], food[{f}], priceRange[cheap], near[{a}] || {n} near {a} serves cheap {f} food.",
            "name[{n}], eatType[{t}], customer rating[high] || The {t} {n} has a high customer rating."]
NAMES, TYPES = ["The Vaults", "Aromi", "Bibimbap House", "The Eagle", "Zizzi"], ["pub", "coffee shop", "restaurant"]
FOODS, AREAS = ["Italian", "French", "Chinese", "English"], ["city centre", "riverside", "Cafe Rouge"]


def fake_jsonl(d: Path, files: int, lines: int = 40) -> list[str]:
    """``files`` JSON-lines files of E2E-like {"text": "<meaning representation> || <reference>"} examples."""
    rng = np.random.default_rng(0)
    paths = []
    for i in range(files):
        p = d / f"train{i}.jsonl"
        rows = [E2E_LIKE[int(rng.integers(3))].format(n=rng.choice(NAMES), t=rng.choice(TYPES),
                                                      f=rng.choice(FOODS), a=rng.choice(AREAS))
                for _ in range(lines)]
        p.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
        paths.append(str(p))
    return paths


def fake_pretrained(d: Path, family: str, texts: list[str], layers: int) -> str:
    """A tiny random model of ``family`` in save_pretrained layout (safetensors) with a BPE tokenizer.json of 300
    tokens trained on ``texts``: what a user's local directory holds, at a CPU test's size."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from raysplit.data.text import train_bpe

    torch.manual_seed(0)
    vocab = 300
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=layers, n_head=2,
                                           bos_token_id=0, eos_token_id=0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                             max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(str(d), safe_serialization=True)
    tok = train_bpe(texts, vocab, d)
    assert tok.vocab_size <= vocab
    return str(d)


@pytest.fixture
def no_network(monkeypatch):
    """Every internet socket refused (local ones, such as Ray's, are not touched); the hub's offline switch
    unset, so that the run must set it itself."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    real = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"a network call to {address!r}")
        return real(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: (_ for _ in ()).throw(
        AssertionError(f"a network call to {address!r}")))


PAPER_SCALE = {"splitlora-gpt2s-e2e.yaml": ("gpt2", 4, 3), "llama-local.yaml": ("llama", 3, 2)}


@pytest.mark.parametrize("name", list(PAPER_SCALE))
def test_a_paper_scale_config_runs_a_round_on_fake_files(name, tmp_path, no_network):
    """The config as shipped but for its paths and sizes: a tiny fake pretrained directory (its own tokenizer),
    fake JSON-lines files, 32-token blocks, batch 4, one step, the local backend; the model's sizes come from the
    directory, so nothing else of the config changes. Nothing reaches the network."""
    family, layers, files = PAPER_SCALE[name]
    paths = fake_jsonl(tmp_path, files)
    texts = [json.loads(line)["text"] for p in paths for line in Path(p).read_text().splitlines()]
    model_dir = fake_pretrained(tmp_path / "model", family, texts, layers)
    cfg = load_config(CONFIGS / name, {**ONE_ROUND, "model.lm.pretrained": model_dir, "data.text.paths": paths,
                                       "data.num_clients": files, "data.text.context_length": 32,
                                       "data.text.test_fraction": 0.1, "train.batch_size": 4,
                                       "eval.batch_size": 16, "eval.every": 1, "runtime.num_workers": 1,
                                       "runtime.server.num_gpus": 0, "runtime.client.num_gpus": 0,
                                       "tracking.output_dir": str(tmp_path / "out")})
    assert cfg.model.lm.family == family and cfg.data.text.tokenizer.kind == "pretrained"
    final = run_experiment(cfg)
    assert 1 < final["eval/perplexity"] < 1.5 * 300 and final["eval/tokens"] > 0
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # the run set it before transformers loaded the directory
    if name.startswith("splitlora"):  # the authors' split: the server holds the head (and receives the targets)
        assert cfg.model.lm.split == "plain" and "comm/bytes_down_middle" not in final
    else:  # U-shaped: the middle's output comes back to the client, which keeps the head and the tokens
        assert cfg.model.lm.split == "u_shaped" and final["comm/bytes_down_middle"] > 0


# ----------------------------------------------------------------------------------------------------------------
# Evidence: SFLV1 with LoRA and one client equals a plain peft LoRA loop
# ----------------------------------------------------------------------------------------------------------------
TINY = {"data.dataset": "digits", "data.num_clients": 1, "data.partition.name": "iid", "data.test_fraction": 0.0,
        "data.text.corpus": "fortunes", "data.text.categories": ["goedel", "magic", "paradoxum", "riddles"],
        "data.text.context_length": 32, "data.text.test_fraction": 0.2, "data.text.tokenizer.vocab_size": 300,
        "model.cut": "block1", "model.lm.family": "gpt2", "model.lm.layers": 3, "model.lm.width": 32,
        "model.lm.heads": 2, "model.lm.max_positions": 32, "model.lm.adapter.rank": 4,
        "model.lm.adapter.target_modules": ["c_attn", "c_fc"], "algorithm.name": "sflv1",
        "train.batch_size": 8, "train.local_steps": 3, "train.rounds": 2, "train.optimizer.name": "adam",
        "train.optimizer.lr": 0.01, "train.participation.count": 1, "runtime.backend": "local",
        "tracking.enabled": False}


def test_sflv1_with_lora_and_one_client_is_a_plain_peft_loop(tmp_path):
    """U-shaped SFLV1, one client, 2 rounds of 3 steps (Adam; its state kept across rounds on both sides, the one
    server copy and the one client averaged into themselves) against transformers' GPT2LMHeadModel under
    ``peft.get_peft_model``, ``model(input_ids=x, labels=x).loss``, one Adam over the adapters, 6 steps on the
    client's batches in the runtime's order (the permutation of (seed, client, epoch)): every adapter equal to
    float rounding, the frozen base unmoved."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from raysplit.runtime import transport

    cfg = make_config(tmp_path, None, **TINY)
    client, server, p, _ = run_rounds(cfg)
    facts = p.inputs.plan.model
    ref = facts.build()
    head, middle, tail = ref.split3(facts.cut, facts.tail_cut)
    client_part = torch.nn.ModuleDict({"head": head, "tail": tail})
    init_c, init_s = transport.unpack_state(p.inputs.client_init), transport.unpack_state(p.inputs.server_init)
    client_part.load_state_dict(init_c)
    middle.load_state_dict(init_s)

    hf = ref.hf_model.config
    ad = cfg.model.lm.adapter
    plain = get_peft_model(
        GPT2LMHeadModel(GPT2Config(vocab_size=hf.vocab_size, n_positions=hf.n_positions, n_embd=hf.n_embd,
                                   n_layer=hf.n_layer, n_head=hf.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0)),
        LoraConfig(r=ad.rank, lora_alpha=ad.alpha, target_modules=list(ad.target_modules), fan_in_fan_out=True,
                   lora_dropout=0.0, bias="none"))
    plain.base_model.model.load_state_dict(ref.hf_model.state_dict(), strict=True)
    plain.train()
    opt = torch.optim.Adam([q for q in plain.parameters() if q.requires_grad], lr=cfg.train.optimizer.lr)
    x_all, idx = p.inputs.train_data["x"], np.asarray(p.inputs.train_idx[0])
    bs, steps, pos, epoch = cfg.train.batch_size, 0, 0, 0
    perm = np.random.default_rng([cfg.seed, 0, 0]).permutation(idx)
    while steps < cfg.train.rounds * cfg.train.local_steps:
        if pos >= len(idx):
            epoch, pos = epoch + 1, 0
            perm = np.random.default_rng([cfg.seed, 0, epoch]).permutation(idx)
        x = torch.as_tensor(x_all[perm[pos:pos + bs]], dtype=torch.long)
        pos += len(x)
        loss = plain(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1

    ref.hf_model.load_state_dict(plain.base_model.model.state_dict())  # the plain model under the split's names
    for got, part, init in ((client, client_part, init_c), (server, middle, init_s)):
        want = part.state_dict()
        assert set(got) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-7, msg=k)
            if "lora_" not in k:
                assert torch.equal(got[k], init[k]), k
    assert any(not torch.equal(server[k], init_s[k]) for k in server if "lora_B" in k)  # the adapters trained
