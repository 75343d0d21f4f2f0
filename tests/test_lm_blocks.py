"""Language-model building blocks (issue 71, items 1, 3, 4 and 6's metrics): tiny GPT-2 and Llama models (2 blocks,
width 32, vocabulary 100), their cuts and payload, local directories, LoRA adapters, text data, tokenizers,
perplexity and generation. No Ray, no MLflow, no network."""

from __future__ import annotations

import json
import math
import socket

import numpy as np
import pytest
import torch

from raysplit.config import validate
from raysplit.data.datasets import DatasetNotFoundError
from raysplit.data.partition import IidPartition, NaturalPartition
from raysplit.data.text import (FORTUNES_DIR, TextConfig, TokenizerConfig, causal_blocks, load_corpus, load_fortunes,
                                load_text_files, load_text_partitioned, load_tokenizer, partition_documents,
                                split_documents, train_bpe)
from raysplit.errors import ConfigError
from raysplit.lm_metrics import evaluate_lm, lm_loss, token_nll
from raysplit.models import (AdapterConfig, HiddenStates, LMConfig, Tokens, build_causal_lm, generate,
                             load_trainable_state, trainable_state)
from raysplit.models.causal_lm import (check_context_length, check_tokenizer_vocab, compose, resolve_lm_cut,
                                       save_base_pretrained)

FAMILIES = ["gpt2", "llama"]
VOCAB, CONTEXT = 100, 16


def tiny(family: str, **kw) -> LMConfig:
    return LMConfig(family=family, layers=2, width=32, heads=4, vocab_size=VOCAB, max_positions=32, **kw)


def built(config: LMConfig, seed: int = 0):
    torch.manual_seed(seed)
    return build_causal_lm(config).eval()


def batch(seed: int = 1, rows: int = 3, length: int = CONTEXT) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


# ---------------------------------------------------------------------------------------------------- the model
def test_every_split_runs_the_unsplit_model(family):
    """For each cut (and a U-shape), the parts in order give the library model's own logits, padding included."""
    model = built(tiny(family, adapter=AdapterConfig(kind="full")))
    ids = batch()
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0
    with torch.no_grad():
        ref = model.hf_model(input_ids=ids, attention_mask=mask).logits
        assert model.block_names == ["embed", "block1", "block2", "head"]
        assert list(model.cut_points()) == ["embed", "block1", "block2"]
        for cut in model.cut_points():
            client, server = model.split(cut)
            torch.testing.assert_close(server(client(Tokens(ids, mask))), ref, rtol=0, atol=1e-6)
        head, middle = model.split_u("embed", "block2")
        torch.testing.assert_close(head.tail(middle(head(Tokens(ids, mask)))), ref, rtol=0, atol=1e-6)


def test_the_cut_payload_is_hidden_states_with_mask_and_positions(family):
    model = built(tiny(family))
    client, _ = model.split("block1")
    ids = batch(rows=2)
    payload = client(ids)
    assert isinstance(payload, HiddenStates)
    assert payload.hidden.shape == (2, CONTEXT, 32)
    assert torch.equal(payload.positions, torch.arange(CONTEXT).expand(2, -1))
    assert torch.equal(payload.attention_mask, torch.ones_like(ids))
    assert payload.nbytes() == 2 * CONTEXT * 32 * 4 + 2 * (2 * CONTEXT * 8)
    received = payload.received()
    assert received.hidden.requires_grad and received.hidden.is_leaf
    moved = payload.detach().to("cpu")
    assert not moved.hidden.requires_grad and all(torch.equal(a, b) for a, b in zip(moved.tensors(), payload.tensors()))


def test_a_cut_outside_the_blocks_names_the_key(family):
    model = built(tiny(family))
    for cut in ("head", "block3", 4, 0):
        with pytest.raises(ConfigError, match=r"model\.cut.*valid cuts: 1 \(embed\), 2 \(block1\), 3 \(block2\)"):
            resolve_lm_cut(model, cut)
    assert resolve_lm_cut(model, None) == model.default_cut == 2  # block1: the first decoder block on the client


def test_a_context_longer_than_the_positions_names_the_key(family):
    model = built(tiny(family))
    check_context_length(model, 32)
    with pytest.raises(ConfigError, match=r"data\.text\.context_length=33 .* 32 positions"):
        check_context_length(model, 33)


def test_an_unknown_family_names_the_key():
    with pytest.raises(Exception, match=r"model\.lm\.family[\s\S]*unknown model family 'bert'"):
        validate({"algorithm": {"name": "splitnn"}, "model": {"lm": {"family": "bert"}}})
    with pytest.raises(ConfigError, match=r"model\.lm\.family is required"):
        build_causal_lm(LMConfig())
    cfg = validate({"algorithm": {"name": "splitnn"}, "model": {"lm": {"family": "llama", "adapter": {"rank": 4}}},
                    "data": {"text": {"context_length": 32}}})
    assert cfg.model.lm.adapter.rank == 4 and cfg.data.text.context_length == 32
    from raysplit.experiment import prepare

    half = validate({"algorithm": {"name": "splitnn"}, "model": {"lm": {"family": "llama"}}})
    with pytest.raises(ConfigError, match=r"model\.lm is set but data\.text is not"):
        prepare(half)  # a run does not quietly train the language model on data.dataset instead


# ------------------------------------------------------------------------------------------ local directories
def test_a_saved_directory_loads_to_the_same_model(family, tmp_path):
    model = built(tiny(family, adapter=AdapterConfig(kind="full")))
    model.hf_model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    loaded = built(LMConfig(pretrained=str(tmp_path / "m"), adapter=AdapterConfig(kind="full")), seed=5)
    assert loaded.family == family and loaded.vocab_size == VOCAB and loaded.max_positions == 32
    ids = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    adapted = built(tiny(family))  # LoRA injected, B moved off zero: saving keeps the base, not the adapters
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    save_base_pretrained(adapted, tmp_path / "base")
    base = built(LMConfig(pretrained=str(tmp_path / "base")))
    with torch.no_grad():
        torch.testing.assert_close(base(ids), built(tiny(family))(ids), rtol=0, atol=0)
    other = "llama" if family == "gpt2" else "gpt2"
    with pytest.raises(ConfigError, match=rf"model\.lm\.family='{other}' but .* holds a '{family}' model"):
        build_causal_lm(LMConfig(family=other, pretrained=str(tmp_path / "m")))


def test_a_missing_or_malformed_directory_is_one_error_naming_it(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=rf"model\.lm\.pretrained: '{missing}' is not a directory"):
        build_causal_lm(LMConfig(pretrained=str(missing)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=rf"'{empty}' has no config.json"):
        build_causal_lm(LMConfig(pretrained=str(empty)))
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=rf"'{empty}' has no safetensors weights"):
        build_causal_lm(LMConfig(pretrained=str(empty)))
    (empty / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=rf"model\.lm\.pretrained: cannot read '{empty / 'config.json'}'"):
        build_causal_lm(LMConfig(pretrained=str(empty)))
    (empty / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match=r"holds a 'bert' model; known families: gpt2, llama"):
        build_causal_lm(LMConfig(pretrained=str(empty)))
    built(tiny("gpt2")).hf_model.config.to_json_file(str(empty / "config.json"))  # a good config, bad weights
    with pytest.raises(ConfigError, match=rf"model\.lm\.pretrained: cannot load the model in '{empty}'"):
        build_causal_lm(LMConfig(pretrained=str(empty)))


def test_nothing_makes_a_network_call(tmp_path, monkeypatch):
    """Building from a config, loading a saved model and its tokenizer run with every socket connection refused."""
    torch.manual_seed(0)
    source = build_causal_lm(tiny("gpt2"))
    save_base_pretrained(source, tmp_path / "m")  # LoRA injected: the base alone is saved
    train_bpe(["a small corpus of words", "more words here"], 300, save_dir=tmp_path / "m")
    calls = []

    def refuse(self, *args, **kwargs):
        calls.append(args)
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    built(tiny("llama"))
    loaded = built(LMConfig(pretrained=str(tmp_path / "m")))
    tok = load_tokenizer(tmp_path / "m")
    check_tokenizer_vocab(loaded, 100)
    assert tok.vocab_size <= 300 and not calls
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1"


# ---------------------------------------------------------------------------------------------------- adapters
def test_only_the_lora_adapters_train(family):
    model = built(tiny(family, adapter=AdapterConfig(rank=4, alpha=8, dropout=0.1)))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    targets = ("c_attn",) if family == "gpt2" else ("q_proj", "v_proj")
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == set(targets)
    client, server = model.split("block1")
    model.train()
    loss = lm_loss(server(client(batch())), batch())
    loss.backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
    full = built(tiny(family, adapter=AdapterConfig(kind="full")))
    assert all(p.requires_grad for p in full.parameters())
    with pytest.raises(ConfigError, match=r"model\.lm\.adapter\.target_modules: \['nope'\]"):
        built(tiny(family, adapter=AdapterConfig(target_modules=["nope"])))


def test_adapter_state_round_trips_per_part(family):
    model = built(tiny(family))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    client, server = model.split("block1")
    state = {side: trainable_state(part) for side, part in (("client", client), ("server", server))}
    assert all("lora_" in k for s in state.values() for k in s) and state["client"] and state["server"]
    fresh = built(tiny(family))  # same seed, same frozen base, zero LoRA B: a different function
    ids = batch()
    with torch.no_grad():
        assert not torch.allclose(fresh(ids), model(ids))
        fresh_client, fresh_server = fresh.split("block1")
        load_trainable_state(fresh_client, state["client"])
        load_trainable_state(fresh_server, state["server"])
        torch.testing.assert_close(fresh(ids), model(ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match="missing"):
        load_trainable_state(fresh_server, state["client"])


# ------------------------------------------------------------------------------------------------------ metrics
def test_perplexity_is_exp_of_the_mean_token_nll():
    model = built(tiny("gpt2"))
    blocks = [batch(seed=s, rows=2) for s in (1, 2)]
    got = evaluate_lm(model, blocks)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in blocks:
            logp = torch.log_softmax(model.hf_model(input_ids=ids).logits.double(), dim=-1)
            for row in range(ids.shape[0]):
                for t in range(ids.shape[1] - 1):
                    total -= float(logp[row, t, ids[row, t + 1]])
                    count += 1
    assert got["tokens"] == count == 2 * 2 * (CONTEXT - 1)
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    mask = torch.ones_like(blocks[0])
    mask[:, 8:] = 0
    s, n = token_nll(model(blocks[0]), blocks[0], mask)
    assert int(n) == 2 * 7


def test_generation_through_the_split_equals_the_whole_model(family):
    model = built(tiny(family))
    prompt = batch(rows=2, length=5)
    client, server = model.split("embed")
    split_out = generate([client, server], prompt, 6, context_length=8)
    whole_out = generate([model], prompt, 6, context_length=8)
    assert split_out.shape == (2, 11) and torch.equal(split_out, whole_out)
    ids = prompt
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model.hf_model(input_ids=ids[:, -8:]).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(split_out, ids)
    assert not model.training
    def sampled(seed, **kw):
        return generate([client, server], prompt, 6, context_length=8, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed), **kw)
    assert torch.equal(sampled(3), sampled(3)) and torch.equal(sampled(3, top_k=1), split_out)
    assert not torch.equal(sampled(3), sampled(4))
    eos = int(split_out[0, 5])  # the first token greedy makes for row 0: every later one is eos
    assert (generate([model], prompt, 6, context_length=8, eos_id=eos)[0, 5:] == eos).all()


# --------------------------------------------------------------------------------------------------------- text
def _fake_fortunes(root):
    root.mkdir()
    for name, n in (("alpha", 6), ("beta", 4), ("gamma", 5)):
        (root / name).write_text("\n%\n".join(f"{name} saying number {i}\nsecond line" for i in range(n)) + "\n%\n")
        (root / f"{name}.dat").write_bytes(b"\x00\x01")
    return root


def test_fortunes_sources_split_and_partition(tmp_path):
    corpus = load_fortunes(str(_fake_fortunes(tmp_path / "f")))
    assert corpus.source_names == ["alpha", "beta", "gamma"] and len(corpus.documents) == 15
    assert corpus.documents[0] == "alpha saying number 0\nsecond line"
    rng = np.random.default_rng(0)
    train, test = split_documents(corpus, 0.2, rng)
    assert len(test) == 1 + 1 + 1 and not set(train) & set(test)
    natural = partition_documents(corpus, train, "natural", 2, rng)
    assert [sorted({corpus.source_names[s] for s in corpus.sources[p]}) for p in natural] == [["alpha", "gamma"],
                                                                                              ["beta"]]
    iid = partition_documents(corpus, train, "iid", 3, rng)
    assert sorted(np.concatenate(iid).tolist()) == train.tolist()
    dirichlet = partition_documents(corpus, train, "dirichlet", 2, rng, alpha=0.5, min_size=1)
    assert sorted(np.concatenate(dirichlet).tolist()) == train.tolist()
    with pytest.raises(ConfigError, match=r"data\.num_clients=4 .* 3 sources"):
        partition_documents(corpus, train, "natural", 4, rng)
    with pytest.raises(DatasetNotFoundError, match=r"apt-get install fortunes-min fortunes"):
        load_fortunes(str(tmp_path / "absent"))
    with pytest.raises(DatasetNotFoundError, match=r"categories here: alpha, beta, gamma"):
        load_fortunes(str(tmp_path / "f"), ["delta"])


def test_a_runs_text_is_blocks_per_client_with_a_saved_tokenizer(tmp_path):
    text = TextConfig(root=str(_fake_fortunes(tmp_path / "f")), context_length=8, test_fraction=0.2,
                      tokenizer=TokenizerConfig(vocab_size=300))
    data = load_text_partitioned(text, NaturalPartition(name="natural"), 3, 0.25, seed=0, save_dir=str(tmp_path / "r"))
    assert (tmp_path / "r" / "tokenizer.json").is_file() and data.spec.kind == "tokens"
    assert data.spec.input_shape == (8,) and data.spec.num_classes == data.tokenizer.vocab_size
    assert data.x_train.dtype == np.int64 and data.x_train.shape[1] == 8 and len(data.x_test) > 0
    for c, (train, test) in enumerate(zip(data.train_idx, data.test_idx)):
        assert len(train) and set(data.y_train[np.concatenate([train, test])]) == {c}  # natural: a source each
    again = load_text_partitioned(text, NaturalPartition(name="natural"), 3, 0.25, seed=0)
    assert np.array_equal(again.x_train, data.x_train) and np.array_equal(again.x_test, data.x_test)
    iid = load_text_partitioned(text, IidPartition(name="iid"), 2, 0.0, seed=1)
    assert sum(map(len, iid.train_idx)) == len(iid.x_train)
    with pytest.raises(ConfigError, match=r"data\.text\.context_length=64: clients \[.*\] hold less text"):
        load_text_partitioned(text.model_copy(update={"context_length": 64}), IidPartition(name="iid"), 3, 0.0, 0)
    with pytest.raises(ConfigError, match=r"kind=pretrained needs data\.text\.tokenizer\.path or "
                                          r"model\.lm\.pretrained"):
        load_text_partitioned(text.model_copy(update={"tokenizer": TokenizerConfig(kind="pretrained")}),
                              IidPartition(name="iid"), 2, 0.0, 0)


@pytest.mark.skipif(not __import__("os").path.isfile(f"{FORTUNES_DIR}/riddles"),
                    reason="Debian's fortunes-min is not installed (scripts/setup.sh installs it)")
def test_the_installed_fortunes_train_a_split_model():
    """The parts together on the real corpus: fortunes-min's three categories, natural partition, a BPE, a tiny
    GPT-2 split after block1; a few full fine-tuning steps on one client's blocks lower the held-out perplexity."""
    corpus = load_corpus(TextConfig(categories=["fortunes", "literature", "riddles"]))
    assert corpus.source_names == ["fortunes", "literature", "riddles"] and len(corpus.documents) > 100
    text = TextConfig(categories=["fortunes", "literature", "riddles"], context_length=32,
                      tokenizer=TokenizerConfig(vocab_size=400))
    data = load_text_partitioned(text, NaturalPartition(name="natural"), 3, 0.1, seed=0)
    torch.manual_seed(0)
    model = build_causal_lm(LMConfig(family="gpt2", layers=2, width=32, heads=4, max_positions=32,
                                     adapter=AdapterConfig(kind="full")), vocab_size=data.tokenizer.vocab_size)
    check_tokenizer_vocab(model, data.tokenizer.vocab_size)
    client, server = model.split("block1")
    held_out = [torch.as_tensor(data.x_test[:64])]
    before = evaluate_lm(compose([client, server]), held_out)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train = torch.as_tensor(data.x_train[data.train_idx[0]])
    for step in range(15):
        ids = train[(step * 8) % len(train):][:8]
        optimizer.zero_grad()
        lm_loss(server(client(ids)), ids).backward()
        optimizer.step()
    after = evaluate_lm(compose([client, server]), held_out)
    assert after["tokens"] == before["tokens"] == len(held_out[0]) * 31
    assert after["perplexity"] < 0.5 * before["perplexity"], (before, after)


def test_user_text_and_jsonl_files(tmp_path):
    (tmp_path / "notes.txt").write_text("first document\n\nsecond document\n")
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(o) for o in (
        {"text": "from ann", "client": "ann"}, {"text": "from bob", "client": "bob"}, {"text": "no client"})))
    corpus = load_text_files([str(tmp_path / "notes.txt"), str(tmp_path / "chat.jsonl")])
    assert corpus.source_names == ["notes", "ann", "bob", "chat"]
    assert corpus.documents == ["first document", "second document", "from ann", "from bob", "no client"]
    assert corpus.sources.tolist() == [0, 0, 1, 2, 3]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2 has no string field 'text'"):
        load_text_files([str(tmp_path / "bad.jsonl")])
    with pytest.raises(ConfigError, match=r"data\.text\.paths: .* is not a file"):
        load_text_files([str(tmp_path / "none.txt")])


def test_a_bpe_is_trained_saved_and_loaded(tmp_path):
    texts = [f"the quick brown fox number {i} jumps over the lazy dog" for i in range(50)]
    tok = train_bpe(texts, 300, save_dir=tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file() and tok.eos_id == 0 and tok.vocab_size == 300
    again = load_tokenizer(tmp_path / "tok")
    text = "the lazy fox, jumps! (unseen: ÿ)"
    assert again.encode(text) == tok.encode(text) and again.decode(again.encode(text)) == text
    blocks = causal_blocks(tok.encode_batch(texts[:5]), 8, tok.eos_id)
    flat = [i for ids in tok.encode_batch(texts[:5]) for i in (*ids, 0)]
    assert blocks.dtype == np.int64 and blocks.shape == (len(flat) // 8, 8)
    assert blocks.flatten().tolist() == flat[: blocks.size]
    with pytest.raises(ConfigError, match=r"data\.text\.tokenizer\.path: no tokenizer at"):
        load_tokenizer(tmp_path / "none")


def test_a_tokenizer_larger_than_the_vocabulary_names_the_key(tmp_path):
    model = built(tiny("llama"))
    tok = train_bpe(["some words to learn from", "and more words"], 300)
    with pytest.raises(ConfigError, match=r"model\.lm\.vocab_size: the trained BPE has 2[0-9]{2} tokens but the "
                                          r"model's vocabulary is 100"):
        check_tokenizer_vocab(model, tok.vocab_size, "the trained BPE")
    torch.manual_seed(0)
    sized = build_causal_lm(LMConfig(family="llama", layers=1, width=32, heads=4), vocab_size=tok.vocab_size)
    check_tokenizer_vocab(sized, tok.vocab_size)
    ids = torch.as_tensor(causal_blocks(tok.encode_batch(["some words to learn from"] * 4), 8, tok.eos_id))
    assert compose(sized.split("embed"))(ids).shape == (len(ids), 8, tok.vocab_size)


def test_lora_on_a_module_a_block_holds_directly_trains_through_the_blocks():
    """peft replaces the LM head (held by the head block, not inside a decoder layer) with its LoRA layer: the
    blocks run the adapted module, so its adapters are the model's and take a gradient."""
    cfg = LMConfig(family="gpt2", layers=1, width=16, heads=2, max_positions=8,
                   adapter=AdapterConfig(target_modules=["c_attn", "lm_head"]))
    model = build_causal_lm(cfg, vocab_size=50)
    assert model.blocks[-1].lm_head is model.hf_model.lm_head
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(n.startswith("blocks.2.lm_head.lora_B") for n in names), names
    ids = torch.randint(0, 50, (2, 8))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    grad = dict(model.named_parameters())["blocks.2.lm_head.lora_B.default.weight"].grad
    assert grad is not None and grad.abs().sum() > 0
