"""Text for causal language models: corpora by source, tokenizers, fixed-length blocks and their partitions.

* **Corpora** (:class:`TextCorpus`: documents, each with the source it came from). The default, which installs
  offline on a fresh Debian machine, is the ``fortunes`` packages (``apt-get install fortunes-min fortunes``):
  every category file under ``/usr/share/games/fortunes`` is a source, every ``%``-separated entry a document. The
  user's own files: ``.txt`` (one document per non-empty line; the file is the source) or ``.jsonl`` (one JSON
  object per line with a text field and an optional client field naming the source).
* **E2E NLG** (Novikova et al. 2017; SplitLoRA's setting, arXiv 2407.00952) in its published CSV format
  (``trainset.csv``, ``devset.csv``, ``testset_w_refs.csv`` with columns ``mr`` and ``ref``): a record is the
  document ``"<mr> || <ref>"`` (the ``||`` separator of the LoRA code's E2E files that SplitLoRA reuses), the
  meaning representation with the separator its prompt, the reference its continuation; trained on the
  training file, held out from ``devset.csv`` or ``testset_w_refs.csv``; a record's source is the value of one
  MR attribute (``name`` by default), for the Dirichlet partition over sources.
* **LEAF Shakespeare** as text: LEAF's ``train/*.json`` and ``test/*.json`` (users, each with 80-character
  windows ``x`` and their next character ``y``), each user's windows stitched back into the lines they were cut
  from; a user (a speaking role of a play) is a source, so the natural partition is LEAF's; LEAF's test windows
  are the held-out documents. Found as :func:`raysplit.data.datasets.load_shakespeare` finds them.
* **Tokenizers** (:class:`TextTokenizer`): a pretrained directory's own (``tokenizer.json``, or GPT-2's
  ``vocab.json`` + ``merges.txt``) or a byte-level BPE trained with ``tokenizers`` on the training split and saved.
* **Blocks**: a client's documents, tokenized, joined by the end-of-text token and cut into blocks of
  ``context_length`` tokens (the remainder shorter than a block is dropped), as ``transformers``' causal-LM
  examples group texts. A block is both the input and, shifted by one, the targets: its labels are its ids, with
  :data:`IGNORE_INDEX` (-100, the Hugging Face convention) where a position is no target. ``data.text.loss_on``:
  ``completion`` (E2E's default, the setting of SplitLoRA and of LoRA's E2E experiment, whose dataset masks the
  context's loss) sets every token of a record's prompt (``"<mr> ||"``) to it, so the loss, perplexity, next-token
  accuracy and ``eval/tokens`` cover the references and the end-of-text token after each; ``all`` (every other
  corpus's default and only choice) scores every token. The records stay packed (no padding); a block that starts
  inside a reference scores it without the MR before it, a block of prompt tokens only scores nothing.
* **Partitions** over documents: ``iid``, ``dirichlet`` (over sources: the source is the label the existing
  partitioners see) and ``natural`` (each client holds whole sources).
* **Generation prompts** (:class:`GenerationConfig`, :func:`generation_prompts`): a few held-out documents, as
  prompt text and their references (E2E: an MR and every reference of it; else a document's first tokens and the
  rest of it).

Nothing here downloads; no Ray, no MLflow.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from raysplit.errors import ConfigError

from .datasets import DatasetNotFoundError, DataSpec
from .partition import client_train_test_split, partition

__all__ = [
    "E2E_FILES",
    "FORTUNES_DIR",
    "IGNORE_INDEX",
    "GenerationConfig",
    "GenerationPrompt",
    "TextConfig",
    "TextCorpus",
    "TextData",
    "TextTokenizer",
    "TokenizerConfig",
    "causal_blocks",
    "causal_labels",
    "generation_prompts",
    "load_e2e",
    "load_shakespeare_text",
    "load_corpus",
    "mr_attributes",
    "load_fortunes",
    "load_text_partitioned",
    "load_text_files",
    "partition_documents",
    "split_documents",
    "text_tokenizer",
    "train_bpe",
    "load_tokenizer",
]

#: Where Debian's fortune packages install their category files.
FORTUNES_DIR = "/usr/share/games/fortunes"
#: The end-of-text token a trained BPE reserves (id 0), GPT-2's spelling.
END_OF_TEXT = "<|endoftext|>"
#: E2E NLG's published files, by split (``data.text.e2e_heldout`` picks the held-out one).
E2E_FILES = {"train": "trainset.csv", "dev": "devset.csv", "test": "testset_w_refs.csv"}
#: What joins an E2E meaning representation and its reference (the LoRA code's E2E files, which SplitLoRA reads).
E2E_SEPARATOR = " || "
#: A label that is no target: ``torch.nn.functional.cross_entropy``'s default ``ignore_index``, as in
#: ``transformers`` (a masked prompt token, :func:`causal_labels`).
IGNORE_INDEX = -100
#: The corpora whose documents are a prompt and its completion (``data.text.loss_on: completion``).
PROMPTED_CORPORA = ("e2e",)


class TokenizerConfig(BaseModel):
    """``data.text.tokenizer``: the pretrained model's own, or a BPE trained on the training split."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)

    kind: Literal["pretrained", "bpe"] = Field(default="bpe", description="pretrained: the tokenizer in "
                                               "model.lm.pretrained (or `path`); bpe: byte-level BPE trained on "
                                               "the training split")
    vocab_size: int = Field(default=512, ge=260, description="bpe: vocabulary size (256 bytes, the end-of-text "
                            "token and the merges)")
    path: str | None = Field(default=None, description="pretrained: a directory or tokenizer.json (null: "
                             "model.lm.pretrained); bpe: where the trained tokenizer is saved")


class GenerationConfig(BaseModel):
    """``data.text.generation``: samples generated through the split model at every evaluation (logged as
    ``generations/round_NNN.json``; on E2E scored as ``eval/bleu`` and ``eval/rouge_l``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)

    prompts: int = Field(default=4, ge=0, description="held-out prompts generated from at each evaluation (0: "
                         "no generation)")
    max_new_tokens: int = Field(default=32, ge=1, description="tokens generated per prompt (fewer where the end-of-"
                                "text token comes first)")
    mode: Literal["greedy", "sample"] = Field(default="greedy", description="greedy: the most likely token; "
                                              "sample: drawn from softmax(logits / temperature)")
    temperature: float = Field(default=1.0, gt=0, description="sample: the softmax temperature")
    top_k: int | None = Field(default=None, ge=1, description="sample: draw among the k most likely tokens only "
                              "(null: all)")
    seed: int = Field(default=0, description="sample: the draw's seed (with the round)")
    prompt_tokens: int = Field(default=16, ge=1, description="corpora other than e2e: a prompt is the first "
                               "tokens of a held-out document, this many")


class TextConfig(BaseModel):
    """``data.text``: a text corpus for a language model, cut into fixed-length causal-LM blocks."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)

    corpus: Literal["fortunes", "files", "e2e", "shakespeare"] = Field(
        default="fortunes", description="fortunes: Debian's fortune packages, one source per category; files: "
        "`paths`; e2e: E2E NLG's CSV files in `root`; shakespeare: LEAF Shakespeare's JSON in `root`, one source "
        "per speaking role")
    root: str | None = Field(default=None, description="fortunes: the directory of category files (null: "
                             f"{FORTUNES_DIR}); e2e: the directory of trainset.csv, devset.csv, "
                             "testset_w_refs.csv; shakespeare: LEAF's data root (as data.root for the LSTM)")
    e2e_heldout: Literal["dev", "test"] = Field(default="dev", description="e2e: the held-out file (dev: "
                                                "devset.csv; test: testset_w_refs.csv)")
    e2e_source: str = Field(default="name", description="e2e: the MR attribute whose value is a record's "
                            "source (the natural and Dirichlet partitions'), e.g. name, eatType, area")
    categories: list[str] | None = Field(default=None, description="fortunes: the categories read (null: all)")
    paths: list[str] = Field(default_factory=list, description="files: .txt (a document per line) or .jsonl "
                             "files")
    text_field: str = Field(default="text", description="jsonl: the field holding a document")
    client_field: str = Field(default="client", description="jsonl: the optional field naming a document's "
                              "source (the natural partition's client)")
    loss_on: Literal["all", "completion"] | None = Field(
        default=None, description="which next tokens the loss and the evaluation score: all (every token); "
        "completion (e2e: a record's reference and its end-of-text token, the MR and its || masked out as SplitLoRA "
        "and LoRA's E2E setup do); null: completion for e2e, all for the other corpora (which have no prompt)")
    context_length: int = Field(default=64, ge=2, description="tokens per block (at most the model's positions)")
    test_fraction: float = Field(default=0.1, ge=0, lt=1, description="documents held out per source for "
                                 "evaluation")
    tokenizer: TokenizerConfig = Field(default=TokenizerConfig(), description="how text becomes token ids")
    generation: GenerationConfig = Field(default=GenerationConfig(), description="samples generated at each "
                                         "evaluation")

    @model_validator(mode="after")
    def _completion_needs_a_prompt(self):
        if self.loss_on == "completion" and self.corpus not in PROMPTED_CORPORA:
            raise ConfigError(f"data.text.loss_on=completion: corpus {self.corpus} has no prompt and completion to "
                              f"tell apart (only {', '.join(PROMPTED_CORPORA)} has); set data.text.loss_on=all")
        return self

    @property
    def scored(self) -> str:
        """``loss_on`` resolved: ``completion`` or ``all`` (null: ``completion`` for a corpus with prompts)."""
        if self.loss_on is not None:
            return self.loss_on
        return "completion" if self.corpus in PROMPTED_CORPORA else "all"


# ----------------------------------------------------------------------------------------------------------------
# Corpora
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TextCorpus:
    """Documents with the index of their source in ``source_names``. ``held_out`` (bool per document, or None):
    the corpus's own held-out documents (E2E's dev or test file, LEAF's test split), used instead of a random
    split; ``prompts`` (E2E): each document's prompt, a prefix of it."""

    name: str
    documents: list[str]
    sources: np.ndarray  # int64, one per document
    source_names: list[str]
    files: tuple[str, ...] = ()
    held_out: np.ndarray | None = None
    prompts: list[str] | None = None

    def __post_init__(self) -> None:
        self.sources = np.asarray(self.sources, dtype=np.int64)
        if len(self.sources) != len(self.documents):
            raise ValueError("one source per document")
        if self.held_out is not None:
            self.held_out = np.asarray(self.held_out, dtype=bool)
            if len(self.held_out) != len(self.documents):
                raise ValueError("one held_out flag per document")
        if self.prompts is not None and len(self.prompts) != len(self.documents):
            raise ValueError("one prompt per document")

    def __repr__(self) -> str:
        return f"TextCorpus({self.name!r}, documents={len(self.documents)}, sources={len(self.source_names)})"


def _corpus(name: str, docs_by_source: dict[str, list[str]], files: Sequence[str]) -> TextCorpus:
    names = [s for s, docs in docs_by_source.items() if docs]
    documents: list[str] = []
    sources: list[int] = []
    for k, s in enumerate(names):
        documents += docs_by_source[s]
        sources += [k] * len(docs_by_source[s])
    return TextCorpus(name, documents, np.asarray(sources, dtype=np.int64), names, tuple(files))


def load_fortunes(root: str | None = None, categories: Sequence[str] | None = None) -> TextCorpus:
    """Debian's fortunes: each category file is a source, each ``%``-separated entry a document.

    Only plain category files are read (not the ``.dat`` indexes, not the ``.u8`` links, not the ``off/``
    folder). A missing directory or category is a :class:`DatasetNotFoundError` saying how to install it."""
    d = Path(root or FORTUNES_DIR)
    how_to = ("  * on Debian/Ubuntu: `apt-get install fortunes-min fortunes` (scripts/setup.sh does it), or point "
              "data.text.root at a folder of fortune files (entries separated by lines holding only '%')")
    files = sorted(p for p in d.glob("*") if p.is_file() and not p.is_symlink() and not p.suffix) if d.is_dir() else []
    if not files:
        raise DatasetNotFoundError("fortunes", [str(d)], how_to)
    if categories is not None:
        by_name = {p.name: p for p in files}
        unknown = [c for c in categories if c not in by_name]
        if unknown:
            raise DatasetNotFoundError("fortunes", [str(d / c) for c in unknown],
                                       how_to + f"\n  * categories here: {', '.join(sorted(by_name))}")
        files = [by_name[c] for c in categories]
    docs: dict[str, list[str]] = {}
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        entries, current = [], []
        for line in text.splitlines():
            if line.strip() == "%":
                entries.append("\n".join(current).strip())
                current = []
            else:
                current.append(line)
        entries.append("\n".join(current).strip())
        docs[p.name] = [e for e in entries if e]
    return _corpus("fortunes", docs, [str(p) for p in files])


def load_text_files(paths: Sequence[str], *, text_field: str = "text", client_field: str = "client") -> TextCorpus:
    """The user's files: ``.txt`` (a document per non-empty line, the file's name is its source) or ``.jsonl``
    (an object per line: ``text_field`` the document, ``client_field``, if present, its source; else the file's
    name). A missing file or a bad line is a ``ConfigError`` naming ``data.text.paths``, the file and the line."""
    if not paths:
        raise ConfigError("data.text.paths is empty: give .txt or .jsonl files (data.text.corpus: files)")
    docs: dict[str, list[str]] = {}
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.is_file():
            raise ConfigError(f"data.text.paths: {str(p)!r} is not a file")
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            if p.suffix == ".jsonl":
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"data.text.paths: {str(p)}:{n} is not JSON ({exc.msg})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                    raise ConfigError(f"data.text.paths: {str(p)}:{n} has no string field {text_field!r} "
                                      "(data.text.text_field)")
                source = str(obj.get(client_field, p.stem))
                docs.setdefault(source, []).append(obj[text_field])
            else:
                docs.setdefault(p.stem, []).append(line.strip())
    return _corpus("files", docs, [str(Path(p).expanduser().resolve()) for p in paths])


_MR_ATTRIBUTE = re.compile(r"\s*([^\[\],]+?)\s*\[([^\]]*)\]\s*")


def _e2e_records(path: Path, key: str) -> list[tuple[str, str]]:
    """``(mr, ref)`` of every row of one E2E CSV file; a missing file, no ``mr`` or ``ref`` column, or an
    empty cell is a ``ConfigError`` naming ``key``, the file and the column (and the line)."""
    if not path.is_file():
        raise ConfigError(f"{key}: no E2E file {str(path)!r} (E2E NLG's trainset.csv, devset.csv and "
                          "testset_w_refs.csv, columns mr and ref; github.com/tuetschek/e2e-dataset)")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            missing = [c for c in ("mr", "ref") if c not in (reader.fieldnames or [])]
            if missing:
                raise ConfigError(f"{key}: {str(path)!r} has no column {missing[0]!r} (an E2E CSV file has the "
                                  f"columns mr and ref; found {reader.fieldnames})")
            out = []
            for n, row in enumerate(reader, start=2):
                mr, ref = (row.get("mr") or "").strip(), (row.get("ref") or "").strip()
                if not mr or not ref:
                    raise ConfigError(f"{key}: {str(path)}:{n} has an empty {'mr' if not mr else 'ref'!r} cell")
                out.append((mr, ref))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{key}: {str(path)!r} is not a readable E2E CSV file: {exc}") from None
    if not out:
        raise ConfigError(f"{key}: {str(path)!r} has no records")
    return out


def mr_attributes(mr: str) -> dict[str, str]:
    """An E2E meaning representation's attributes: ``"name[The Eagle], food[French]"`` -> ``{"name": "The
    Eagle", "food": "French"}``."""
    return {m.group(1): m.group(2) for m in _MR_ATTRIBUTE.finditer(mr)}


def load_e2e(root: str | None, heldout: str = "dev", source: str = "name") -> TextCorpus:
    """E2E NLG from its published CSV files in ``root`` (module docstring): documents ``"<mr> || <ref>"`` of
    ``trainset.csv`` and, held out, of ``devset.csv`` (``heldout="dev"``) or ``testset_w_refs.csv``; each
    document's prompt is ``"<mr> ||"``; its source the MR's ``source`` attribute (``"none"`` where absent)."""
    key = "data.text.root"
    if root is None:
        raise ConfigError(f"{key} is null: data.text.corpus=e2e reads {E2E_FILES['train']}, {E2E_FILES['dev']} and "
                          f"{E2E_FILES['test']} from the directory it names")
    d = Path(root).expanduser()
    if not d.is_dir():
        raise ConfigError(f"{key}: {str(d)!r} is not a directory (data.text.corpus=e2e)")
    files = [d / E2E_FILES["train"], d / E2E_FILES[heldout]]
    records = [(r, False) for r in _e2e_records(files[0], key)] + [(r, True) for r in _e2e_records(files[1], key)]
    names: dict[str, int] = {}
    documents, sources, held, prompts = [], [], [], []
    for (mr, ref), is_held in records:
        src = mr_attributes(mr).get(source, "none")
        sources.append(names.setdefault(src, len(names)))
        prompts.append(mr + E2E_SEPARATOR.rstrip())
        documents.append(mr + E2E_SEPARATOR + ref)
        held.append(is_held)
    return TextCorpus("e2e", documents, np.asarray(sources, np.int64), list(names), tuple(str(f) for f in files),
                      held_out=np.asarray(held), prompts=prompts)


def _stitched(xs: list, ys: list, where: str) -> list[str]:
    """LEAF's windows of one user back into text: a window that continues the text so far (its characters are
    the last ones of it) adds its next character, any other starts a new document."""
    docs: list[str] = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        if not isinstance(x, str) or not isinstance(y, str):
            raise ConfigError(f"data.text.root: {where}, sample {i}: 'x' and 'y' must be strings (LEAF "
                              f"Shakespeare), got {type(x).__name__} and {type(y).__name__}")
        if docs and len(docs[-1]) >= len(x) and docs[-1].endswith(x):
            docs[-1] += y
        else:
            docs.append(x + y)
    return docs


def load_shakespeare_text(root: str | None = None) -> TextCorpus:
    """LEAF Shakespeare as text (module docstring): each user's windows stitched into documents, the user (a
    play's speaking role) their source, the documents of LEAF's test files held out. Files are found and read
    as :func:`raysplit.data.datasets.load_shakespeare` does; none found, or a malformed one, is a ``ConfigError``
    naming ``data.text.root`` (and the file, or every place looked at)."""
    from .datasets import _LEAF_HOWTO, _leaf_load, _root

    try:
        train, test = _leaf_load(root, "shakespeare", _LEAF_HOWTO.format(
            name="shakespeare", args="-s niid --sf 0.2 -k 0 -t sample --tf 0.9",
            dest=_root(root) / "shakespeare"))
    except (ValueError, DatasetNotFoundError) as exc:  # not found: where it looked and how to get the files
        raise ConfigError(f"data.text.root: {exc}") from None
    names: dict[str, int] = {}
    documents, sources, held, files = [], [], [], set()
    for records, is_held in ((train, False), (test, True)):
        by_user: dict[str, tuple[list, list, Path]] = {}
        for u, xs, ys, path in records:
            acc = by_user.setdefault(u, ([], [], path))
            acc[0].extend(xs)
            acc[1].extend(ys)
            files.add(str(path))
        for u, (xs, ys, path) in by_user.items():
            for doc in _stitched(xs, ys, f"{path}: LEAF user {u!r}"):
                documents.append(doc)
                sources.append(names.setdefault(u, len(names)))
                held.append(is_held)
    return TextCorpus("shakespeare", documents, np.asarray(sources, np.int64), list(names), tuple(sorted(files)),
                      held_out=np.asarray(held, dtype=bool))


def load_corpus(config: TextConfig) -> TextCorpus:
    """The corpus ``config`` names."""
    if config.corpus == "fortunes":
        return load_fortunes(config.root, config.categories)
    if config.corpus == "e2e":
        return load_e2e(config.root, config.e2e_heldout, config.e2e_source)
    if config.corpus == "shakespeare":
        return load_shakespeare_text(config.root)
    return load_text_files(config.paths, text_field=config.text_field, client_field=config.client_field)


def split_documents(corpus: TextCorpus, test_fraction: float, rng: np.random.Generator
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Train and test document indices: the corpus's own held-out documents where it has them
    (``corpus.held_out``), else ``round(test_fraction * n)`` documents of each source held out (so every source
    is in both where it has two documents or more)."""
    if corpus.held_out is not None:
        return (np.flatnonzero(~corpus.held_out).astype(np.int64), np.flatnonzero(corpus.held_out).astype(np.int64))
    train, test = [], []
    for k in range(len(corpus.source_names)):
        idx = rng.permutation(np.flatnonzero(corpus.sources == k))
        n_test = int(round(test_fraction * len(idx))) if len(idx) > 1 else 0
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)).astype(np.int64), np.sort(np.concatenate(test)).astype(np.int64)


def partition_documents(corpus: TextCorpus, doc_idx: np.ndarray, name: str, num_clients: int,
                        rng: np.random.Generator, **params) -> list[np.ndarray]:
    """Document indices (into ``corpus``) per client. ``natural``: whole sources per client, source ``k`` (in
    corpus order, among those in ``doc_idx``) to client ``k mod num_clients``, so no source is split or dropped;
    needs ``num_clients`` <= the sources. ``iid``, ``dirichlet`` and the other label partitioners run on the
    documents with their source as the label (``dirichlet``: a Dirichlet over sources per client)."""
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    labels = corpus.sources[doc_idx]
    if name == "natural":
        present = np.unique(labels)
        if num_clients > len(present):
            raise ConfigError(f"data.num_clients={num_clients} but the natural partition has {len(present)} "
                              f"sources ({corpus.name}); lower it or use iid / dirichlet")
        owner = {int(s): j % num_clients for j, s in enumerate(present)}
        return [np.sort(doc_idx[[owner[int(s)] == c for s in labels]]) for c in range(num_clients)]
    return [doc_idx[p] for p in partition(name, labels, num_clients, rng, **params)]


# ----------------------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------------------
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the end-of-text id blocks are joined by; ``vocab_size`` counts every id
    it can produce (added tokens included)."""

    def __init__(self, tokenizer, eos_id: int, source: str):
        self.tokenizer = tokenizer
        self.eos_id = int(eos_id)
        self.source = source

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts))]

    def prompt_lengths(self, texts: Sequence[str], prompts: Sequence[str]) -> list[int]:
        """How many of the first tokens of each of ``texts`` (as :meth:`encode_batch` cuts it) are its prompt (a
        prefix of it, the same index of ``prompts``): those that start within the prompt's characters (a token
        across the boundary is the prompt's)."""
        out = []
        for enc, text, prompt in zip(self.tokenizer.encode_batch(list(texts)), texts, prompts):
            if not text.startswith(prompt):
                raise ValueError(f"prompt {prompt[:40]!r} is not a prefix of its document {text[:40]!r}")
            out.append(sum(1 for start, _ in enc.offsets if start < len(prompt)))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def save(self, path: str | Path) -> Path:
        """``tokenizer.json`` in directory ``path`` (created); the file's path."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(d / "tokenizer.json"))
        return d / "tokenizer.json"


def train_bpe(texts: Sequence[str], vocab_size: int, save_dir: str | Path | None = None) -> TextTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) trained on ``texts`` with ``tokenizers``; id 0 is
    ``<|endoftext|>``. Saved as ``save_dir/tokenizer.json`` when ``save_dir`` is given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    out = TextTokenizer(tok, tok.token_to_id(END_OF_TEXT), "bpe")
    if save_dir is not None:
        out.source = str(out.save(save_dir))
    return out


def load_tokenizer(path: str | Path, key: str = "data.text.tokenizer.path") -> TextTokenizer:
    """A saved tokenizer: ``tokenizer.json`` (a file, or in directory ``path``) or GPT-2's ``vocab.json`` +
    ``merges.txt``. The end-of-text id is ``<|endoftext|>``'s, else ``</s>``'s, else the directory's
    ``config.json`` ``eos_token_id``. Local files only; a missing one is a ``ConfigError`` naming ``key``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    p = Path(path).expanduser()
    d = p if p.is_dir() else p.parent
    if p.is_file() and p.suffix == ".json":
        try:
            tok = Tokenizer.from_file(str(p))
        except Exception as exc:
            raise ConfigError(f"{key}: cannot read tokenizer {str(p)!r}: {exc}") from None
    elif (d / "tokenizer.json").is_file():
        try:
            tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as exc:
            raise ConfigError(f"{key}: cannot read tokenizer {str(d / 'tokenizer.json')!r}: {exc}") from None
    elif (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        tok = Tokenizer(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        raise ConfigError(f"{key}: no tokenizer at {str(p)!r} (tokenizer.json, or vocab.json and merges.txt)")
    eos = next((tok.token_to_id(t) for t in (END_OF_TEXT, "</s>") if tok.token_to_id(t) is not None), None)
    if eos is None and (d / "config.json").is_file():
        eos = json.loads((d / "config.json").read_text()).get("eos_token_id")
    if eos is None:
        raise ConfigError(f"{key}: the tokenizer at {str(p)!r} has no end-of-text token ({END_OF_TEXT} or </s>)")
    return TextTokenizer(tok, int(eos), str(p))


# ----------------------------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------------------------
def causal_blocks(token_lists: Sequence[Sequence[int]], context_length: int, eos_id: int) -> np.ndarray:
    """Documents' token ids joined, each followed by ``eos_id``, cut into ``(N, context_length)`` int64 blocks;
    the tail shorter than a block is dropped."""
    if context_length < 2:
        raise ConfigError(f"data.text.context_length={context_length}: a block needs at least 2 tokens")
    flat: list[int] = []
    for ids in token_lists:
        flat.extend(ids)
        flat.append(eos_id)
    n = len(flat) // context_length
    return np.asarray(flat[: n * context_length], dtype=np.int64).reshape(n, context_length)


def causal_labels(token_lists: Sequence[Sequence[int]], prompt_lengths: Sequence[int], context_length: int,
                  eos_id: int) -> np.ndarray:
    """The labels of :func:`causal_blocks`' blocks of the same documents: their ids, with :data:`IGNORE_INDEX`
    on the first ``prompt_lengths[i]`` tokens of document ``i`` (its prompt; its end-of-text token is a target,
    the completion's end, as LoRA's E2E dataset scores it)."""
    flat: list[int] = []
    for ids, n_prompt in zip(token_lists, prompt_lengths):
        n_prompt = min(int(n_prompt), len(ids))
        flat.extend([IGNORE_INDEX] * n_prompt)
        flat.extend(ids[n_prompt:])
        flat.append(eos_id)
    n = len(flat) // context_length
    return np.asarray(flat[: n * context_length], dtype=np.int64).reshape(n, context_length)


# ----------------------------------------------------------------------------------------------------------------
# Generation prompts
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GenerationPrompt:
    """A prompt (text, tokenized where it is generated from) and the references a continuation is scored
    against (E2E: every reference of the MR; else the rest of the document)."""

    prompt: str
    references: tuple[str, ...]
    source: str


def _spread(n_items: int, n: int) -> list[int]:
    """``n`` indices spread evenly over ``range(n_items)`` (all of them where ``n >= n_items``)."""
    if n >= n_items:
        return list(range(n_items))
    return sorted({int(round(i)) for i in np.linspace(0, n_items - 1, n)})


def generation_prompts(corpus: TextCorpus, test_docs: np.ndarray, tokenizer: TextTokenizer,
                       config: GenerationConfig) -> list[GenerationPrompt]:
    """``config.prompts`` prompts from the held-out documents ``test_docs``, spread evenly over them. E2E
    (``corpus.prompts``): the distinct MRs (``"<mr> ||"``) with all their references, as E2E's metrics group
    them; other corpora: the first ``config.prompt_tokens`` tokens of a document longer than that, decoded, and
    the rest of it as the reference."""
    if config.prompts == 0 or len(test_docs) == 0:
        return []
    names = corpus.source_names
    if corpus.prompts is not None:
        groups: dict[str, list[int]] = {}
        for i in test_docs:
            groups.setdefault(corpus.prompts[int(i)], []).append(int(i))
        keys = list(groups)
        return [GenerationPrompt(keys[k], tuple(corpus.documents[i][len(keys[k]):].strip() for i in groups[keys[k]]),
                                 names[int(corpus.sources[groups[keys[k]][0]])])
                for k in _spread(len(keys), config.prompts)]
    n_tok = config.prompt_tokens
    ids = tokenizer.encode_batch([corpus.documents[int(i)] for i in test_docs])
    long_enough = [(int(i), t) for i, t in zip(test_docs, ids) if len(t) > n_tok]
    return [GenerationPrompt(tokenizer.decode(t[:n_tok]), (tokenizer.decode(t[n_tok:]),), names[int(corpus.sources[i])])
            for i, t in (long_enough[k] for k in _spread(len(long_enough), config.prompts))]


# ----------------------------------------------------------------------------------------------------------------
# A run's text, partitioned
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TextData:
    """A run's text as it would train on it, in the arrays a token dataset already has: ``x_train`` ``(N,
    context_length)`` int64 blocks of every client (client ``c``'s are ``train_idx[c]``, its own test split
    ``test_idx[c]``), ``x_test`` the blocks of the held-out documents; ``y_*`` the source index of each block (for
    partition statistics: a block's tokens are its labels). ``spec.num_classes`` is the tokenizer's vocabulary.
    ``prompts``: what generation at each evaluation starts from (:func:`generation_prompts`). ``t_train`` and
    ``t_test``: the labels of the blocks, row for row (:func:`causal_labels` where ``data.text.loss_on`` is
    ``completion``; else the blocks themselves, the same arrays)."""

    spec: DataSpec
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    train_idx: list[np.ndarray]
    test_idx: list[np.ndarray]
    tokenizer: TextTokenizer
    source_names: list[str]
    provenance: dict
    prompts: list[GenerationPrompt] = dataclasses.field(default_factory=list)
    t_train: np.ndarray | None = None
    t_test: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.t_train = self.x_train if self.t_train is None else self.t_train
        self.t_test = self.x_test if self.t_test is None else self.t_test


def _blocks_of(corpus: TextCorpus, docs: np.ndarray, tokenizer: TextTokenizer, context_length: int,
               completion: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of ``docs`` source by source (a block never mixes two sources), their labels (``completion``:
    the prompts masked, :func:`causal_labels`; else the blocks themselves) and each block's source."""
    xs, ts, ys = [np.zeros((0, context_length), np.int64)], [np.zeros((0, context_length), np.int64)], \
        [np.zeros(0, np.int64)]
    for k in np.unique(corpus.sources[docs]):
        mine = docs[corpus.sources[docs] == k]
        texts = [corpus.documents[i] for i in mine]
        ids = tokenizer.encode_batch(texts)
        blocks = causal_blocks(ids, context_length, tokenizer.eos_id)
        xs.append(blocks)
        if completion:
            ts.append(causal_labels(ids, tokenizer.prompt_lengths(texts, [corpus.prompts[i] for i in mine]),
                                    context_length, tokenizer.eos_id))
        ys.append(np.full(len(blocks), k, np.int64))
    x = np.concatenate(xs)
    return x, (np.concatenate(ts) if completion else x), np.concatenate(ys)


def text_tokenizer(config: TextConfig, train_texts: Sequence[str], *, pretrained: str | None = None,
                   save_dir: str | None = None) -> TextTokenizer:
    """``data.text.tokenizer``'s tokenizer: the pretrained one (``path``, else the model's directory
    ``pretrained``), or a BPE trained on ``train_texts`` and saved in ``path`` or ``save_dir``."""
    tok = config.tokenizer
    if tok.kind == "pretrained":
        where = tok.path or pretrained
        if where is None:
            raise ConfigError("data.text.tokenizer.kind=pretrained needs data.text.tokenizer.path or "
                              "model.lm.pretrained")
        return load_tokenizer(where, "data.text.tokenizer.path" if tok.path else "model.lm.pretrained")
    return train_bpe(train_texts, tok.vocab_size, tok.path or save_dir)


def load_text_partitioned(text: TextConfig, partition_config, num_clients: int, client_test_fraction: float,
                          seed: int, *, pretrained: str | None = None, save_dir: str | None = None) -> TextData:
    """The corpus of ``text``, its documents split into training and held-out ones (``text.test_fraction`` per
    source), the training documents partitioned over ``num_clients`` (``partition_config``: the ``data.partition``
    section; natural is by source), the tokenizer (a trained BPE sees the training documents of every client,
    pooled: a central step, as SplitLoRA's shared vocabulary is), then each client's documents cut into blocks
    and split into its train and test blocks (``client_test_fraction``). ``seed``: the run's."""
    corpus = load_corpus(text)
    train_docs, test_docs = split_documents(corpus, text.test_fraction, np.random.default_rng([seed, 5]))
    rng = np.random.default_rng([seed, 1])
    try:
        parts = partition_documents(corpus, train_docs, partition_config.name, num_clients, rng,
                                    **partition_config.params())
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"data.partition: {exc}") from None
    tokenizer = text_tokenizer(text, [corpus.documents[i] for i in train_docs], pretrained=pretrained,
                               save_dir=save_dir)
    completion = text.scored == "completion"
    if completion and corpus.prompts is None:  # the config refuses it; a corpus built by hand may not have them
        raise ConfigError(f"data.text.loss_on=completion: corpus {corpus.name} has no prompts; set "
                          "data.text.loss_on=all")
    xs, ts, ys, owners = [], [], [], []
    for c, docs in enumerate(parts):
        x, t, y = _blocks_of(corpus, docs, tokenizer, text.context_length, completion)
        xs.append(x)
        ts.append(t)
        ys.append(y)
        owners.append(np.full(len(x), c, np.int64))
    empty = [c for c, x in enumerate(xs) if len(x) == 0]
    if empty:
        raise ConfigError(f"data.text.context_length={text.context_length}: clients {empty[:10]} hold less text "
                          f"than one block; lower it or data.num_clients")
    x_train, y_train, owner = np.concatenate(xs), np.concatenate(ys), np.concatenate(owners)
    t_train = np.concatenate(ts) if completion else x_train
    x_test, t_test, y_test = _blocks_of(corpus, test_docs, tokenizer, text.context_length, completion)
    by_client = [np.flatnonzero(owner == c) for c in range(num_clients)]
    train_idx, test_idx = client_train_test_split(by_client, client_test_fraction, rng)
    spec = DataSpec(name=corpus.name, kind="tokens", input_shape=(text.context_length,),
                    num_classes=tokenizer.vocab_size)
    provenance = {"name": corpus.name, "files": list(corpus.files), "sources": len(corpus.source_names),
                  "documents": len(corpus.documents), "tokenizer": tokenizer.source,
                  "partition": {"name": partition_config.name, **partition_config.params(),
                                "num_clients": num_clients},
                  "train_blocks": int(len(x_train)), "test_blocks": int(len(x_test)), "loss_on": text.scored,
                  "seed": seed}
    prompts = generation_prompts(corpus, test_docs, tokenizer, text.generation)
    return TextData(spec, x_train, y_train, x_test, y_test, train_idx, test_idx, tokenizer, corpus.source_names,
                    provenance, prompts, t_train, t_test)
