"""Text data, metrics and generation of language-model runs (issue 71, items 4 and 6): E2E NLG's CSV files and
LEAF Shakespeare's JSON read in their published formats (small fake files here), partitioned by source; one bad
file is one error naming the file and the key; BLEU and ROUGE-L from sacrebleu and rouge-score; a tiny run on E2E
logs its tokenizer, a generation artifact per evaluation, eval/bleu, eval/rouge_l, tokens per second and bytes per
token; ``raysplit.run``, ``raysplit.compare`` and a sweep take a language model as they take an image model."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from raysplit.data.text import (GenerationConfig, TextConfig, generation_prompts, load_corpus, load_e2e,
                                load_shakespeare_text, mr_attributes, partition_documents, split_documents, train_bpe)
from raysplit.errors import ConfigError

NAMES = ["The Eagle", "The Mill", "Aromi", "Zizzi"]
FOODS = ["French", "Italian", "Chinese", "English"]


def write_e2e(root: Path, n_train: int = 48) -> Path:
    """E2E NLG's files as published (csv, a header ``mr,ref``, quoted cells with commas): ``n_train`` training
    records over four restaurant names; a dev and a test file of two MRs with three references each."""
    root.mkdir(parents=True, exist_ok=True)

    def rows(n, offset=0):
        out = []
        for i in range(n):
            name, food = NAMES[(i + offset) % 4], FOODS[(i // 4 + offset) % 4]
            mr = f"name[{name}], eatType[restaurant], food[{food}], area[city centre]"
            out.append((mr, f"{name} is a {food} restaurant in the city centre."))
        return out

    def write(fname, records):
        with open(root / fname, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, quoting=csv.QUOTE_ALL)
            w.writerow(["mr", "ref"])
            w.writerows(records)

    write("trainset.csv", rows(n_train))
    held = [(mr, ref) for mr, ref in rows(2, offset=1) for _ in range(3)]
    held = [(mr, ref if k % 3 == 0 else ref.replace("is a", "serves") if k % 3 == 1 else "Try " + ref)
            for k, (mr, ref) in enumerate(held)]
    write("devset.csv", held)
    write("testset_w_refs.csv", held[:3])
    return root


LINES = {"THE_TEMPEST_PROSPERO": "Now does my project gather to a head: my charms crack not.",
         "THE_TEMPEST_ARIEL": "All hail, great master! grave sir, hail! I come to answer thy best pleasure.",
         "HAMLET_HAMLET": "To be, or not to be, that is the question: whether tis nobler in the mind to suffer."}


def write_leaf_shakespeare(root: Path, window: int = 8) -> Path:
    """LEAF Shakespeare's layout (``shakespeare/data/{train,test}/*.json``: ``users``, ``user_data`` with
    ``window``-character ``x`` and next-character ``y``), each user's windows cut from one line, the last quarter
    of them in the test file (LEAF 80 characters; shorter here)."""
    blobs = {"train": {"users": [], "user_data": {}, "num_samples": []},
             "test": {"users": [], "user_data": {}, "num_samples": []}}
    for user, text in LINES.items():
        xs = [text[i:i + window] for i in range(len(text) - window)]
        ys = [text[i + window] for i in range(len(text) - window)]
        cut = 3 * len(xs) // 4
        for split, sl in (("train", slice(0, cut)), ("test", slice(cut, None))):
            b = blobs[split]
            b["users"].append(user)
            b["user_data"][user] = {"x": xs[sl], "y": ys[sl]}
            b["num_samples"].append(len(xs[sl]))
    for split, blob in blobs.items():
        d = root / "shakespeare" / "data" / split
        d.mkdir(parents=True, exist_ok=True)
        (d / f"all_data_niid_0_keep_0_{split}_9.json").write_text(json.dumps(blob))
    return root


def test_e2e_records_are_prompt_and_reference_held_out_from_the_dev_file(tmp_path):
    corpus = load_e2e(str(write_e2e(tmp_path / "e2e")), "dev", "name")
    assert len(corpus.documents) == 48 + 6 and corpus.held_out.sum() == 6
    assert corpus.source_names[:4] == NAMES  # the MR's name attribute is the source
    doc, prompt = corpus.documents[0], corpus.prompts[0]
    assert doc == "name[The Eagle], eatType[restaurant], food[French], area[city centre] || The Eagle is a French " \
                  "restaurant in the city centre." and doc.startswith(prompt) and prompt.endswith(" ||")
    assert mr_attributes(prompt) == {"name": "The Eagle", "eatType": "restaurant", "food": "French",
                                     "area": "city centre"}
    train, test = split_documents(corpus, 0.5, np.random.default_rng(0))  # the file's split, not a random one
    assert list(test) == list(range(48, 54)) and len(train) == 48
    assert load_e2e(str(tmp_path / "e2e"), "test", "food").held_out.sum() == 3
    assert load_e2e(str(tmp_path / "e2e"), "dev", "food").source_names[:4] == FOODS

    tok = train_bpe([corpus.documents[i] for i in train], 300)
    prompts = generation_prompts(corpus, test, tok, GenerationConfig(prompts=5))
    assert len(prompts) == 2  # the distinct MRs, each with every one of its references, as E2E scores them
    assert all(len(p.references) == 3 and p.prompt.endswith("||") for p in prompts)
    assert prompts[0].references[0] == "The Mill is a Italian restaurant in the city centre."


def test_e2e_partitions_iid_natural_and_dirichlet_over_sources(tmp_path):
    corpus = load_e2e(str(write_e2e(tmp_path / "e2e", n_train=80)), "dev", "name")
    train, _ = split_documents(corpus, 0.1, np.random.default_rng(0))
    natural = partition_documents(corpus, train, "natural", 2, np.random.default_rng(1))
    assert [sorted({corpus.source_names[s] for s in corpus.sources[p]}) for p in natural] == [
        ["Aromi", "The Eagle"], ["The Mill", "Zizzi"]]  # whole sources: a restaurant's records on one client
    for name, params in (("iid", {}), ("dirichlet", {"alpha": 0.3})):
        parts = partition_documents(corpus, train, name, 3, np.random.default_rng(1), **params)
        assert sorted(np.concatenate(parts).tolist()) == sorted(train.tolist())  # every training record, once
    with pytest.raises(ConfigError, match="natural partition has 4 sources"):
        partition_documents(corpus, train, "natural", 5, np.random.default_rng(1))


@pytest.mark.parametrize("damage, says", [
    ("missing", "data.text.root: no E2E file .*devset.csv"),
    ("no_ref", "data.text.root: .*devset.csv' has no column 'ref'"),
    ("empty", r"data.text.root: .*devset.csv:3 has an empty 'ref' cell"),
])
def test_a_missing_or_malformed_e2e_file_is_one_error_naming_it_and_the_key(tmp_path, damage, says):
    root = write_e2e(tmp_path / "e2e")
    dev = root / "devset.csv"
    if damage == "missing":
        dev.unlink()
    elif damage == "no_ref":
        dev.write_text("mr,reference\n\"name[A]\",\"A is a pub.\"\n")
    else:
        dev.write_text("mr,ref\n\"name[A]\",\"A is a pub.\"\n\"name[B]\",\"\"\n")
    with pytest.raises(ConfigError, match=says):
        load_corpus(TextConfig(corpus="e2e", root=str(root)))


# ---- E2E's loss on the completion only (data.text.loss_on) -------------------------------------------------------
def hand_mask(blocks: np.ndarray, sources: np.ndarray, tok, eos: int) -> np.ndarray:
    """Which labels of packed E2E blocks (consecutive within a source, each source's stream starting with a
    record's MR) are targets, found here without the library's offsets: every token up to the one whose text so
    far ends with ``" ||"`` is the prompt's (masked), every later one up to and with the end-of-text token the
    completion's."""
    keep, in_prompt, text = np.zeros(blocks.shape, bool), True, ""
    for idx, t in np.ndenumerate(blocks):
        if idx[1] == 0 and idx[0] > 0 and sources[idx[0]] != sources[idx[0] - 1]:
            in_prompt, text = True, ""
        keep[idx] = not in_prompt
        if in_prompt:
            text += tok.decode([int(t)])
            in_prompt = not text.endswith(" ||")
        elif t == eos:
            in_prompt, text = True, ""
    return keep


def e2e_text(root, **over) -> TextConfig:
    return TextConfig(corpus="e2e", root=str(root), context_length=24, tokenizer={"vocab_size": 300}, **over)


def test_e2e_labels_mask_the_prompt_and_loss_on_all_keeps_the_blocks_as_labels(tmp_path):
    from raysplit.data.text import IGNORE_INDEX, load_text_partitioned

    root = write_e2e(tmp_path / "e2e", n_train=16)
    part = validate_data({"partition": {"name": "iid"}}).partition
    masked = load_text_partitioned(e2e_text(root), part, 1, 0.0, 0)
    plain = load_text_partitioned(e2e_text(root, loss_on="all"), part, 1, 0.0, 0)
    assert e2e_text(root).scored == "completion" and TextConfig().scored == "all"  # the per-corpus default
    assert masked.provenance["loss_on"] == "completion" and plain.provenance["loss_on"] == "all"
    np.testing.assert_array_equal(masked.x_train, plain.x_train)  # the same blocks; only the labels differ
    assert plain.t_train is plain.x_train and plain.t_test is plain.x_test  # today's labels: the blocks
    tok, eos = masked.tokenizer, masked.tokenizer.eos_id
    for x, t, src in ((masked.x_train, masked.t_train, masked.y_train), (masked.x_test, masked.t_test,
                                                                          masked.y_test)):
        keep = hand_mask(x, src, tok, eos)
        np.testing.assert_array_equal(t, np.where(keep, x, IGNORE_INDEX))
    # the targets of the first two blocks (the first record's MR fills the first): its reference, no MR
    first = masked.t_train[:2].reshape(-1)
    text = tok.decode([int(i) for i in first[first != IGNORE_INDEX]])
    assert text.startswith(" The Eagle is a French restaurant in the")
    assert 0.3 < (masked.t_train == IGNORE_INDEX).mean() < 0.8 and "||" not in text and "name[" not in text


def validate_data(data: dict):
    from raysplit.config import validate

    return validate({"data": data}).data


@pytest.mark.parametrize("corpus, extra", [("fortunes", {}), ("files", {"paths": ["x.txt"]}),
                                           ("shakespeare", {})])
def test_loss_on_completion_for_a_corpus_without_prompts_is_one_error_naming_the_key(corpus, extra):
    with pytest.raises(ConfigError, match=rf"data.text.loss_on=completion: corpus {corpus} has no prompt.*"
                                          r"set data.text.loss_on=all"):
        validate_data({"text": {"corpus": corpus, "loss_on": "completion", **extra}})
    assert validate_data({"text": {"corpus": corpus, **extra}}).text.scored == "all"


def test_the_lm_losses_and_the_evaluation_loop_skip_the_ignored_targets():
    from raysplit.data import DataSpec
    from raysplit.lm_metrics import IGNORE_INDEX, evaluate_lm, lm_eval_metrics, lm_loss, lm_sample_losses, token_nll
    from raysplit.runtime.evaluation import EvalTally, predict_batches

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=g)
    ids = torch.randint(0, 11, (3, 6), generator=g)
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX  # a prompt of 4 tokens: targets at positions 4, 5 of block 0
    labels[1, :] = IGNORE_INDEX  # a block of prompt only
    logp = torch.log_softmax(logits, -1)
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # (3, 5): the NLL of every next token
    keep = labels[:, 1:] != IGNORE_INDEX
    assert int(keep.sum()) == 2 + 0 + 5
    torch.testing.assert_close(lm_loss(logits, labels), nll[keep].mean())
    total, count = token_nll(logits, labels)
    torch.testing.assert_close(total, nll[keep].sum())
    assert int(count) == 7
    torch.testing.assert_close(lm_sample_losses(logits, labels), torch.stack([nll[0, 3:].mean(), torch.tensor(0.0),
                                                                               nll[2].mean()]))
    torch.testing.assert_close(lm_loss(logits, ids), nll.mean())  # nothing ignored: every next token, as before
    torch.testing.assert_close(lm_sample_losses(logits, ids), nll.mean(1))
    ev = evaluate_lm(lambda x: logits, [(ids, labels)])
    assert ev["tokens"] == 7 and ev["loss"] == pytest.approx(float(nll[keep].mean()), rel=1e-6)
    tally = predict_batches(ids.numpy(), labels.numpy(), DataSpec("t", "tokens", (6,), 11), 3, lambda x: logits,
                            EvalTally(), language_model=True)
    y, p, loss = tally.result()
    np.testing.assert_array_equal(y, ids[:, 1:][keep].numpy())
    np.testing.assert_array_equal(p, logits[:, :-1].argmax(-1)[keep].numpy())
    m = lm_eval_metrics(y, p, loss)
    assert m["tokens"] == 7 and m["loss"] == pytest.approx(float(nll[keep].mean()), rel=1e-6)


def test_masked_labels_pass_the_servers_screen_and_are_not_scored_by_the_next_token_attack():
    from types import SimpleNamespace

    from raysplit.lm_metrics import IGNORE_INDEX
    from raysplit.runtime.screening import activation_form_fault
    from raysplit.token_privacy import next_token_leak

    y = np.array([[IGNORE_INDEX, IGNORE_INDEX, 3, 4]])
    act = SimpleNamespace(x=np.zeros((1, 4, 2), np.float32), y=y, tag=SimpleNamespace(round=0))
    assert activation_form_fault(act, (4, 2), np.float32, 10, 0, label_shape=(4,)) == ""
    act.y = np.array([[-1, 2, 3, 4]])  # any other negative label is still out of range
    assert "out of range" in activation_form_fault(act, (4, 2), np.float32, 10, 0, label_shape=(4,))
    rows = torch.randn(10, 2, generator=torch.Generator().manual_seed(1))  # the head's rows, one per token
    ids = torch.tensor([[0, 5, 3, 4]])
    g = -rows[torch.tensor([[5, 3, 4, 0]])]  # a perfect leak at every position
    assert next_token_leak(g, ids, rows)["next_token_leak"] == 1.0
    g[0, 0] = rows[5]  # position 0's gradient points away from its target 5
    assert next_token_leak(g, ids, rows)["next_token_leak"] == pytest.approx(2 / 3)
    masked = torch.tensor([[0, IGNORE_INDEX, 3, 4]])  # ... which is masked: not scored
    assert next_token_leak(g, masked, rows)["next_token_leak"] == 1.0
    assert next_token_leak(g, torch.full((1, 4), IGNORE_INDEX), rows) == {}


@pytest.mark.parametrize("loss_on", ["completion", "all"])
def test_an_e2e_runs_loss_is_the_mean_cross_entropy_over_the_completion_tokens(tmp_path, loss_on):
    """SFLV1, U-shaped, one client whose batch is every block it holds, LoRA, Adam, against a loop written here
    with ``peft``'s LoRA on the same initial weights and blocks, the loss the mean cross-entropy over the next
    tokens :func:`hand_mask` finds to be references (``loss_on: completion``, E2E's default) or over every next
    token (``all``, today's). After 2 rounds of 2 steps the adapters agree to float rounding; the run's first
    logged loss is the loop's first."""
    from helpers import make_config, run_rounds
    from test_lm_methods import assert_states_close, full_model_state, peft_reference

    root = write_e2e(tmp_path / "e2e", n_train=16)
    over = {**{k: v for k, v in e2e_overrides(root, tmp_path, None).items()
               if not k.startswith(("tracking.", "runtime.server", "runtime.client"))},
            "data.num_clients": 1, "data.partition.name": "iid", "train.participation.count": 1,
            "train.batch_size": 4096, "data.text.generation.prompts": 0, "tracking.enabled": False,
            "data.dataset": "digits", "data.text.loss_on": loss_on,
            "model.lm.adapter.target_modules": ["c_attn", "c_fc", "lm_head"]}
    cfg = make_config(tmp_path, None, **over)
    client, server, p, stats = run_rounds(cfg)
    facts = p.inputs.plan.model
    peft_model, init = peft_reference(cfg, p)
    opt = torch.optim.Adam([prm for prm in peft_model.parameters() if prm.requires_grad], lr=cfg.train.optimizer.lr)
    order = np.sort(p.inputs.train_idx[0])  # the client's blocks, source by source, in order
    blocks = p.inputs.train_data["x"][order]
    x = torch.as_tensor(blocks)
    keep = torch.as_tensor(hand_mask(blocks, p.text.y_train[order], p.text.tokenizer, p.text.tokenizer.eos_id))
    keep = keep[:, 1:]
    if loss_on == "all":
        keep = torch.ones_like(keep)
    assert 0 < int(keep.sum()) and (loss_on == "all") == bool(keep.all())
    losses = []
    for _ in range(cfg.train.rounds * cfg.train.local_steps):
        opt.zero_grad()
        logits = peft_model(input_ids=x).logits
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="none")
        loss = nll[keep.flatten()].mean()
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    loop = {k[len("base_model.model."):]: v.detach() for k, v in peft_model.state_dict().items()}
    assert_states_close(full_model_state(facts, client, server), loop, init, atol=2e-5)
    first = stats[0].clients[0]
    assert first["loss_sum"] / first["loss_n"] == pytest.approx(sum(losses[:2]) / 2, rel=1e-4)


def test_leaf_shakespeare_is_each_roles_lines_stitched_with_leafs_test_held_out(tmp_path):
    root = write_leaf_shakespeare(tmp_path / "leaf")
    corpus = load_corpus(TextConfig(corpus="shakespeare", root=str(root)))
    assert corpus.source_names == list(LINES)  # a speaking role per source: the natural partition is LEAF's
    train, test = split_documents(corpus, 0.5, np.random.default_rng(0))
    for k, (user, line) in enumerate(LINES.items()):
        mine_train = [corpus.documents[i] for i in train if corpus.sources[i] == k]
        mine_test = [corpus.documents[i] for i in test if corpus.sources[i] == k]
        assert len(mine_train) == len(mine_test) == 1  # contiguous windows: one document each
        assert line.startswith(mine_train[0]) and line.endswith(mine_test[0])
        assert len(mine_train[0]) == 8 + 3 * (len(line) - 8) // 4
    parts = partition_documents(corpus, train, "natural", 3, np.random.default_rng(0))
    assert [corpus.sources[p].tolist() for p in parts] == [[0], [1], [2]]


def test_a_missing_or_malformed_leaf_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"data.text.root: dataset 'shakespeare' not found(.|\n)*nowhere"):
        load_shakespeare_text(str(tmp_path / "nowhere"))
    root = write_leaf_shakespeare(tmp_path / "leaf")
    bad = next((root / "shakespeare" / "data" / "test").glob("*.json"))
    bad.write_text(json.dumps({"users": ["U"], "user_data": {"U": {"x": [1, 2], "y": ["a", "b"]}}}))
    with pytest.raises(ConfigError, match=rf"data.text.root: .*{bad.name}: LEAF user 'U', sample 0: 'x' and 'y'"):
        load_shakespeare_text(str(root))
    bad.write_text("{\"users\": [")
    with pytest.raises(ConfigError, match=rf"data.text.root: .*{bad.name}: not a readable LEAF JSON"):
        load_shakespeare_text(str(root))


def test_bleu_and_rouge_l_come_from_sacrebleu_and_rouge_score():
    import sacrebleu
    from rouge_score import rouge_scorer

    from raysplit.lm_metrics import generation_scores

    refs = [["the eagle is a french restaurant", "the eagle serves french food"], ["zizzi is a pub"]]
    perfect = generation_scores(["the eagle serves french food", "zizzi is a pub"], refs)
    assert perfect == pytest.approx({"bleu": 100.0, "rouge_l": 1.0})
    hyps = ["the eagle is french", "a pub"]
    got = generation_scores(hyps, refs)
    want_bleu = sacrebleu.corpus_bleu(hyps, [["the eagle is a french restaurant", "zizzi is a pub"],
                                             ["the eagle serves french food", None]]).score
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    want_rouge = np.mean([max(scorer.score(r, h)["rougeL"].fmeasure for r in rs) for h, rs in zip(hyps, refs)])
    assert got == pytest.approx({"bleu": want_bleu, "rouge_l": want_rouge}) and 0 < got["rouge_l"] < 1


def test_generated_text_runs_through_the_split_parts():
    """generate_text through a U-shaped split's three parts equals it through the whole model: greedy twice the
    same, sampled reproducible by its seed."""
    import torch

    from raysplit.lm_metrics import generate_text
    from raysplit.models.causal_lm import LMConfig, build_causal_lm

    tok = train_bpe(["the cat sat on the mat", "a dog ran in the park"] * 5, 270)
    torch.manual_seed(0)
    model = build_causal_lm(LMConfig(family="gpt2", layers=2, width=16, heads=2, max_positions=32),
                            vocab_size=tok.vocab_size, fixed_length=True)
    head, middle, tail = model.split3(2, 3)
    kw = dict(max_new_tokens=6, context_length=32)
    split = generate_text([head, middle, tail], tok, ["the cat", "a dog"], **kw)
    assert split == generate_text([model], tok, ["the cat", "a dog"], **kw)
    drawn = [generate_text([head, middle, tail], tok, ["the cat"], greedy=False, seed=s, **kw) for s in (1, 1, 2)]
    assert drawn[0] == drawn[1] and all(isinstance(t, str) for t in split)


# ---- a run on E2E, through the Python API, compared, swept --------------------------------------------------
def e2e_overrides(root: Path, tmp_path: Path, uri: str) -> dict:
    return {"name": "e2e-tiny", "seed": 0, "algorithm.name": "sflv1", "data.num_clients": 2,
            "data.partition.name": "natural", "data.test_fraction": 0.0, "data.text.corpus": "e2e",
            "data.text.root": str(root), "data.text.context_length": 24, "data.text.tokenizer.vocab_size": 300,
            "data.text.generation.prompts": 2, "data.text.generation.max_new_tokens": 8,
            "model.cut": "block1", "model.lm.family": "gpt2", "model.lm.layers": 2, "model.lm.width": 16,
            "model.lm.heads": 2, "model.lm.max_positions": 32, "model.lm.adapter.rank": 2,
            "train.rounds": 2, "train.batch_size": 8, "train.local_steps": 2, "train.optimizer.name": "adam",
            "train.optimizer.lr": 0.01, "eval.batch_size": 64, "runtime.backend": "local",
            "runtime.server.num_cpus": 0.5, "runtime.client.num_cpus": 0.5, "tracking.uri": uri,
            "tracking.experiment": "lm-data", "tracking.progress": False,
            "tracking.output_dir": str(tmp_path / "outputs")}


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    """One tiny split GPT-2 run on fake E2E files, through ``raysplit.run``, tracked in its own store."""
    import raysplit

    tmp = tmp_path_factory.mktemp("e2e_run")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    root = write_e2e(tmp / "e2e", n_train=64)
    return raysplit.run({}, e2e_overrides(root, tmp, uri)), uri, root, tmp


def test_an_e2e_run_logs_generations_scores_tokenizer_and_throughput(e2e_run):
    from mlflow.tracking import MlflowClient

    result, uri, root, tmp = e2e_run
    client = MlflowClient(uri)
    files = {a.path for a in client.list_artifacts(result.run_id, "generations")}
    assert files == {"generations/round_000.json", "generations/round_001.json"}  # one per evaluation
    local = Path(client.download_artifacts(result.run_id, "generations/round_001.json"))
    record = json.loads(local.read_text())
    assert record["round"] == 1 and record["greedy"] is True and len(record["samples"]) == 2
    sample = record["samples"][0]
    assert sample["prompt"].endswith("||") and len(sample["references"]) == 3 and isinstance(sample["generated"], str)
    assert record["scores"]["bleu"] == pytest.approx(result.final["eval/bleu"])
    assert {a.path for a in client.list_artifacts(result.run_id, "tokenizer")} == {"tokenizer/tokenizer.json"}
    from raysplit.data.text import load_tokenizer

    tok = load_tokenizer(client.download_artifacts(result.run_id, "tokenizer/tokenizer.json"))
    assert tok.vocab_size == 300  # the BPE trained on the training split, as the run used it
    m = client.get_run(result.run_id).data.metrics
    assert 0 <= m["eval/bleu"] <= 100 and 0 <= m["eval/rouge_l"] <= 1 and m["eval/perplexity"] > 1
    # every round: 2 clients x 2 steps x 8 blocks x 24 tokens; bytes per token the round's traffic over them
    assert m["train/tokens"] == 2 * 2 * 8 * 24 and m["train/tokens_per_s"] > 0
    assert m["comm/bytes_per_token"] == pytest.approx((m["comm/bytes_up"] + m["comm/bytes_down"]) / m["train/tokens"])
    assert list(result.rounds["eval/perplexity"].dropna().index) == [0, 1]  # the Python API's rounds
    # E2E's default loss_on: completion: the evaluation counts the held-out references' next tokens only
    from raysplit.config import load_config
    from raysplit.data.text import IGNORE_INDEX, load_text_partitioned

    cfg = load_config(None, e2e_overrides(root, tmp, uri))
    text = load_text_partitioned(cfg.data.text, cfg.data.partition, 2, 0.0, cfg.seed)
    scored = int((text.t_test[:, 1:] != IGNORE_INDEX).sum())
    assert 0 < scored < text.t_test[:, 1:].size and m["eval/tokens"] == scored


def test_compare_tables_language_model_runs_by_perplexity(e2e_run):
    import raysplit

    result, uri, _, _ = e2e_run
    cmp = raysplit.compare("lm-data", uri, metric="eval/perplexity")
    row = cmp.runs.set_index("run_id").loc[result.run_id[:8]]
    ppl = result.rounds["eval/perplexity"].dropna()
    assert row["eval/perplexity"] == pytest.approx(ppl.iloc[-1]) and row["rounds"] == 2
    assert row["best"] == pytest.approx(ppl.min())  # the lowest perplexity is the best
    assert "eval/perplexity" in cmp.table


@pytest.mark.slow
def test_a_sweep_minimises_perplexity_over_language_model_trials(ray_session, e2e_run, tmp_path):
    from raysplit.tuning import run_sweep

    _, _, root, _ = e2e_run
    uri = f"sqlite:///{tmp_path / 'sweep.db'}"
    base = tmp_path / "base.yaml"
    over = e2e_overrides(root, tmp_path, uri)
    over.update({"train.rounds": 1, "data.text.generation.prompts": 0})
    from raysplit.config import apply_overrides

    base.write_text(yaml.safe_dump(apply_overrides({}, over)))
    spec = {"base": str(base), "space": {"train.optimizer.lr": {"grid": [0.01, 1e-6]}},
            "metric": "eval/perplexity", "mode": "min", "scheduler": "fifo", "max_concurrent_trials": 1,
            "storage_path": str(tmp_path / "tune"), "name": "lm"}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    results = run_sweep(str(tmp_path / "sweep.yaml"), [])
    df = results.get_dataframe()
    assert len(df) == 2 and not results.errors
    best = results.get_best_result(metric="eval/perplexity", mode="min")
    assert best.config["train.optimizer.lr"] == 0.01 and np.isfinite(best.metrics["eval/perplexity"])
