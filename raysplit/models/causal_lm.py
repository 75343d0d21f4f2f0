"""Decoder language models from Hugging Face ``transformers``, cut at decoder-block granularity.

Two families, GPT-2 (``GPT2LMHeadModel``) and Llama (``LlamaForCausalLM``), each either built from a config with
random initial weights (the tiny sizes used on CPU and in the tests) or loaded from a local ``save_pretrained``
directory (safetensors). Nothing is ever downloaded: a load is ``local_files_only`` with ``HF_HUB_OFFLINE`` set, and
a missing or malformed directory is one :class:`~raysplit.errors.ConfigError` naming it.

raysplit does not reimplement the model: the blocks below hold the library's own modules (embeddings, decoder
layers, final norm, LM head), so ``server(client(x))`` runs exactly the computation of the unsplit model. The
blocks of a :class:`CausalLM` are ``embed``, ``block1`` .. ``blockN``, ``head``; as elsewhere in the zoo a cut is
named after the last block on the client (``embed``: the client keeps only the embeddings), so the cuts are
``embed``, ``block1`` .. ``blockN`` (``head`` is the last block, not a cut).

What crosses a cut is a :class:`HiddenStates` payload: the hidden states plus the attention mask and the positions
that the next decoder layer needs (each layer rebuilds its 4-D causal mask and, for Llama, its rotary embeddings
from them, as the unsplit model does once before its first layer). :meth:`HiddenStates.nbytes` is what the
``comm/*`` counters would charge. A run (``experiment.prepare``) builds the model ``fixed_length``: its text is
fixed-length blocks without padding, so the hidden-states tensor alone crosses the cut (the mask all ones, the
positions ``0 .. T-1``, recomputed by the next block) and the runtime's one-tensor path carries it; the payload
is kept for padded inputs, which no run makes yet.

Tied embeddings (GPT-2's default) share one parameter between ``embed`` and ``head``; in a U-shaped split both are
on the client, in a plain split the LM head's weight is the embedding table the client also holds.

No Ray, no MLflow; ``transformers`` is imported only when a model is built (it costs seconds per process).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from raysplit.errors import ConfigError

from .adapters import AdapterConfig
from .core import SplitModel

__all__ = [
    "FAMILIES",
    "CausalLM",
    "HiddenStates",
    "LMConfig",
    "Tokens",
    "build_causal_lm",
    "check_context_length",
    "check_tokenizer_vocab",
    "compose",
    "generate",
    "resolve_lm_cut",
    "save_base_pretrained",
    "shared_base_model",
]

#: Model families raysplit can cut: ``model_type`` of the ``transformers`` config -> causal-LM class name.
FAMILIES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


class LMConfig(BaseModel):
    """``model.lm``: a decoder language model, from a config (random weights) or a local pretrained directory."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)

    family: str | None = Field(default=None, description="gpt2 or llama; required without `pretrained`, checked "
                               "against the directory's config.json with it")
    pretrained: str | None = Field(default=None, description="a local `save_pretrained` directory (config.json and "
                                   "safetensors weights); never downloaded. null: random initial weights from the "
                                   "sizes below")
    layers: int = Field(default=2, ge=1, description="decoder blocks (random init)")
    width: int = Field(default=64, ge=8, description="hidden size (random init)")
    heads: int = Field(default=4, ge=1, description="attention heads (random init); divides width")
    kv_heads: int | None = Field(default=None, ge=1, description="llama: key/value heads (null: heads)")
    mlp_width: int | None = Field(default=None, ge=1, description="feed-forward width (null: 4 x width)")
    vocab_size: int | None = Field(default=None, ge=2, description="vocabulary (random init; null: the "
                                   "tokenizer's)")
    max_positions: int = Field(default=256, ge=2, description="longest context the model takes (random init)")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout of embeddings, attention and residuals "
                           "(random init)")
    tie_embeddings: bool = Field(default=True, description="the LM head shares the embedding table (random init)")
    attention: Literal["sdpa", "eager"] = Field(default="sdpa", description="transformers' attention kernel")
    adapter: AdapterConfig = Field(default=AdapterConfig(), description="what trains: LoRA adapters (peft) or "
                                   "every weight")
    split: Literal["u_shaped", "plain"] = Field(default="u_shaped", description="u_shaped: the client keeps the "
                                                "embeddings, the blocks up to model.cut and the head with the loss "
                                                "(model.tail_cut null: the last block; the tokens, which are the "
                                                "labels, never leave it); plain: the server holds the head and "
                                                "receives the token blocks as labels, so it sees the text")

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str | None) -> str | None:
        if v is not None and v not in FAMILIES:
            raise ValueError(f"unknown model family {v!r}; known families: {', '.join(FAMILIES)}")
        return v


# ----------------------------------------------------------------------------------------------------------------
# What enters the model and what crosses a cut
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Tokens:
    """Token ids ``(B, T)`` with their attention mask (1 = token, 0 = padding; default all ones) and positions
    (default ``0 .. T-1`` in every row, as ``transformers`` does when none are given)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def filled(self) -> "Tokens":
        ids = self.input_ids
        mask = self.attention_mask if self.attention_mask is not None else torch.ones_like(ids)
        pos = self.positions
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        return Tokens(ids, mask, pos)


@dataclasses.dataclass
class HiddenStates:
    """What crosses a cut of a :class:`CausalLM`: ``hidden`` ``(B, T, D)``, ``attention_mask`` ``(B, T)`` and
    ``positions`` ``(B, T)``. Only ``hidden`` carries a gradient."""

    hidden: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.hidden.shape

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hidden, self.attention_mask, self.positions

    def nbytes(self) -> int:
        """Bytes on the wire: the three tensors' elements times their element sizes."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def detach(self) -> "HiddenStates":
        return HiddenStates(*(t.detach() for t in self.tensors()))

    def to(self, device: torch.device | str) -> "HiddenStates":
        return HiddenStates(*(t.to(device) for t in self.tensors()))

    def received(self) -> "HiddenStates":
        """The payload as the receiving side starts from it: ``hidden`` detached and a leaf that requires grad
        (its ``.grad`` after the backward pass is what goes back), mask and positions detached."""
        return HiddenStates(self.hidden.detach().requires_grad_(True), self.attention_mask.detach(),
                            self.positions.detach())


# ----------------------------------------------------------------------------------------------------------------
# Blocks (each holds the library's own modules)
# ----------------------------------------------------------------------------------------------------------------
def _as_tokens(x: Tokens | torch.Tensor) -> Tokens:
    if isinstance(x, torch.Tensor):
        x = Tokens(x)
    if not isinstance(x, Tokens):
        raise TypeError(f"the embed block takes token ids (a LongTensor) or Tokens, got {type(x).__name__}")
    return x.filled()


def _payload(x: HiddenStates | torch.Tensor, what: str) -> HiddenStates:
    """``x`` as a :class:`HiddenStates`: a bare hidden-states tensor ``(B, T, D)`` (a fixed-length model's cut)
    gets the mask and positions of an unpadded block (all ones; ``0 .. T-1`` in every row)."""
    if isinstance(x, HiddenStates):
        return x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} takes HiddenStates or a hidden-states tensor, got {type(x).__name__}")
    b, t = x.shape[0], x.shape[1]
    positions = torch.arange(t, device=x.device).unsqueeze(0).expand(b, -1)
    return HiddenStates(x, torch.ones((b, t), dtype=torch.long, device=x.device), positions)


class _Embed(nn.Module):
    """An embedding block: its output is the :class:`HiddenStates` payload, or the hidden tensor alone in a
    fixed-length model (``fixed_length``, set by :class:`CausalLM`; not a module attribute of the state)."""

    fixed_length = False

    def _out(self, hidden: torch.Tensor, t: Tokens) -> HiddenStates | torch.Tensor:
        return hidden if self.fixed_length else HiddenStates(hidden, t.attention_mask, t.positions)


class GPT2Embed(_Embed):
    """GPT-2's token and learned position embeddings, then embedding dropout (``GPT2Model.forward``'s prologue)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, x: Tokens | torch.Tensor) -> HiddenStates | torch.Tensor:
        t = _as_tokens(x)
        return self._out(self.drop(self.wte(t.input_ids) + self.wpe(t.positions)), t)


class LlamaEmbed(_Embed):
    """Llama's token embeddings (its positions are rotary, applied inside each layer)."""

    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, x: Tokens | torch.Tensor) -> HiddenStates | torch.Tensor:
        t = _as_tokens(x)
        return self._out(self.embed_tokens(t.input_ids), t)


def _causal_mask(config, hidden: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor):
    """transformers' own 4-D causal mask for ``config``'s attention kernel (the keyword was ``input_embeds`` before
    transformers 5.2x; both spellings are accepted)."""
    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": attention_mask, "past_key_values": None}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    if "position_ids" in params:
        kwargs["position_ids"] = positions
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return create_causal_mask(**kwargs)


class DecoderBlock(nn.Module):
    """One decoder layer of the library (``GPT2Block`` / ``LlamaDecoderLayer``) over a :class:`HiddenStates`."""

    def __init__(self, layer: nn.Module, config, rotary: nn.Module | None = None):
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # Llama's rotary embedding (buffers only), shared by the blocks
        self.hf_config = config  # the library config (not a module): its attention kernel and mask rules

    def forward(self, x: HiddenStates | torch.Tensor) -> HiddenStates | torch.Tensor:
        if isinstance(x, torch.Tensor):  # a fixed-length model's cut: the hidden tensor in, the hidden tensor out
            return self.forward(_payload(x, "a decoder block")).hidden
        if not isinstance(x, HiddenStates):
            raise TypeError(f"a decoder block takes HiddenStates, got {type(x).__name__}")
        mask = _causal_mask(self.hf_config, x.hidden, x.attention_mask, x.positions)
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": x.positions}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(x.hidden, position_ids=x.positions)
        out = self.layer(x.hidden, **kwargs)
        if isinstance(out, tuple):  # transformers < 5 returned (hidden, ...)
            out = out[0]
        return HiddenStates(out, x.attention_mask, x.positions)


class LMHead(nn.Module):
    """The final norm and the LM head: ``HiddenStates -> logits (B, T, V)``."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: HiddenStates | torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(_payload(x, "the head block").hidden))


class CausalLM(SplitModel):
    """A :class:`SplitModel` over a ``transformers`` causal LM: blocks ``embed``, ``block1`` .. ``blockN``,
    ``head``; ``model(ids)`` returns the logits. ``hf_model`` is the library's model (the same modules, outside
    this module tree); ``family``, ``max_positions`` and ``vocab_size`` describe it.

    ``fixed_length``: the input is fixed-length blocks without padding (what :mod:`raysplit.data.text` makes), so
    what crosses a cut is the hidden-states tensor ``(B, T, D)`` alone: its mask is all ones and its positions
    ``0 .. T-1``, which the next block recomputes (the runtime's one-tensor activation path carries it, and its
    bytes are the hidden states'). Off, the blocks pass the :class:`HiddenStates` payload, kept for padded inputs
    (the runtime does not carry it yet). The weights and their names are the same either way."""

    def __init__(self, hf_model: nn.Module, family: str, *, fixed_length: bool = False):
        cfg = hf_model.config
        max_positions = int(cfg.n_positions if family == "gpt2" else cfg.max_position_embeddings)
        super().__init__(_library_blocks(hf_model, family), name=family, input_kind="tokens",
                         vocab_size=int(cfg.vocab_size), input_shape=(max_positions,))
        object.__setattr__(self, "hf_model", hf_model)
        self.family = family
        self.max_positions = max_positions
        self.default_cut = self.resolve_cut("block1" if len(self.blocks) > 3 else "embed")
        self.fixed_length = fixed_length
        self.blocks[0].fixed_length = fixed_length

    def refresh_blocks(self) -> None:
        """The blocks over the library model's modules as they are now: after ``peft`` replaced some (a LoRA
        layer in place of the LM head or the embeddings the blocks held), so that the blocks run the adapted
        ones."""
        for i, (_, block) in enumerate(_library_blocks(self.hf_model, self.family)):
            self.blocks[i] = block
        self.blocks[0].fixed_length = self.fixed_length


def _library_blocks(hf_model: nn.Module, family: str) -> list[tuple[str, nn.Module]]:
    """``embed``, ``block1`` .. ``blockN``, ``head`` over the library model's own modules."""
    cfg = hf_model.config
    if family == "gpt2":
        body = hf_model.transformer
        blocks: list[tuple[str, nn.Module]] = [("embed", GPT2Embed(body.wte, body.wpe, body.drop))]
        blocks += [(f"block{i + 1}", DecoderBlock(layer, cfg)) for i, layer in enumerate(body.h)]
        return blocks + [("head", LMHead(body.ln_f, hf_model.lm_head))]
    body = hf_model.model
    blocks = [("embed", LlamaEmbed(body.embed_tokens))]
    blocks += [(f"block{i + 1}", DecoderBlock(layer, cfg, body.rotary_emb)) for i, layer in enumerate(body.layers)]
    return blocks + [("head", LMHead(body.norm, hf_model.lm_head))]


# ----------------------------------------------------------------------------------------------------------------
# Building and loading
# ----------------------------------------------------------------------------------------------------------------
def _hf_config(config: LMConfig, vocab_size: int):
    from transformers import GPT2Config, LlamaConfig

    if config.width % config.heads:
        raise ConfigError(f"model.lm.heads={config.heads} does not divide model.lm.width={config.width}")
    mlp = config.mlp_width or 4 * config.width
    if config.family == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_positions=config.max_positions, n_embd=config.width,
                          n_layer=config.layers, n_head=config.heads, n_inner=mlp, resid_pdrop=config.dropout,
                          embd_pdrop=config.dropout, attn_pdrop=config.dropout,
                          tie_word_embeddings=config.tie_embeddings, bos_token_id=0, eos_token_id=0)
    kv = config.kv_heads or config.heads
    if config.heads % kv:
        raise ConfigError(f"model.lm.kv_heads={kv} does not divide model.lm.heads={config.heads}")
    return LlamaConfig(vocab_size=vocab_size, hidden_size=config.width, intermediate_size=mlp,
                       num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=kv,
                       max_position_embeddings=config.max_positions, attention_dropout=config.dropout,
                       tie_word_embeddings=config.tie_embeddings, bos_token_id=0, eos_token_id=0, pad_token_id=None)


def _offline() -> None:
    """No download can start: the hub's offline switches (read by huggingface_hub at import, so set before the
    first import too, and again on its constants if it is already imported)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import huggingface_hub.constants as hub_constants

        hub_constants.HF_HUB_OFFLINE = True
    except (ImportError, AttributeError):
        pass


def _check_pretrained_dir(path: str) -> Path:
    key = "model.lm.pretrained"
    d = Path(path).expanduser()
    if not d.is_dir():
        raise ConfigError(f"{key}: {str(d)!r} is not a directory (models are loaded from local save_pretrained "
                          "directories only; nothing is downloaded)")
    if not (d / "config.json").is_file():
        raise ConfigError(f"{key}: {str(d)!r} has no config.json (not a save_pretrained directory)")
    if not (list(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").is_file()):
        raise ConfigError(f"{key}: {str(d)!r} has no safetensors weights (model.safetensors or "
                          "model.safetensors.index.json)")
    return d


def _load_pretrained(config: LMConfig) -> tuple[nn.Module, str]:
    _offline()
    from transformers import AutoConfig, AutoModelForCausalLM

    d = _check_pretrained_dir(config.pretrained)
    key = "model.lm.pretrained"
    try:
        hf_config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    except Exception as exc:  # malformed JSON, unknown model_type, ...: one error naming the directory
        raise ConfigError(f"{key}: cannot read {str(d / 'config.json')!r}: {exc}") from None
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise ConfigError(f"{key}: {str(d)!r} holds a {family!r} model; known families: {', '.join(FAMILIES)}")
    if config.family is not None and config.family != family:
        raise ConfigError(f"model.lm.family={config.family!r} but {str(d)!r} holds a {family!r} model")
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, use_safetensors=True,
                                                        attn_implementation=config.attention)
    except Exception as exc:
        raise ConfigError(f"{key}: cannot load the model in {str(d)!r}: {exc}") from None
    return hf_model, family


def build_causal_lm(config: LMConfig, *, vocab_size: int | None = None, fixed_length: bool = False) -> CausalLM:
    """The model of ``config`` with its adapters applied (:func:`~raysplit.models.adapters.apply_adapters`).

    From a local directory when ``config.pretrained`` is set (its vocabulary is its own), else random initial
    weights of ``config``'s sizes with ``config.vocab_size`` or, when that is null, ``vocab_size`` (the
    tokenizer's). ``fixed_length``: see :class:`CausalLM`. Seeding (``torch.manual_seed``) is the caller's job.
    Errors are :class:`ConfigError` naming the key at fault.
    """
    from .adapters import apply_adapters

    if config.pretrained is not None:
        hf_model, family = _load_pretrained(config)
    else:
        if config.family is None:
            raise ConfigError(f"model.lm.family is required without model.lm.pretrained; known families: "
                              f"{', '.join(FAMILIES)}")
        size = config.vocab_size or vocab_size
        if size is None:
            raise ConfigError("model.lm.vocab_size is null and no tokenizer gave one")
        _offline()
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_config(_hf_config(config, int(size)),
                                                    attn_implementation=config.attention)
        family = config.family
    model = CausalLM(hf_model, family, fixed_length=fixed_length)
    apply_adapters(model, config.adapter)
    return model


#: one frozen base per process (:func:`shared_base_model`): the template each copy shares its base with, by source
_BASES: "OrderedDict[tuple, CausalLM]" = OrderedDict()
_BASES_KEPT = 4  # templates kept per process (a sweep's trials in one process build a few configs)


def shared_base_model(config: LMConfig, *, vocab_size: int | None, seed: int, fixed_length: bool = False,
                      device: torch.device | str | None = None, digest: str | None = None) -> CausalLM:
    """The model of ``config`` with its own adapters over this process's one frozen base of that source.

    The first call for a source (``config``, ``vocab_size``, ``seed``, ``fixed_length``) and ``device`` builds the
    template, as a run's driver does: ``torch.manual_seed(seed)`` then :func:`build_causal_lm` (inside a forked
    random state, so the caller's stream does not move), moved to ``device``; later calls copy it with
    :func:`~raysplit.models.adapters.copy_sharing_base`, so every copy's frozen tensors are the template's (the
    same storage) and only its adapters are its own (their initial values the template's; callers load states).
    ``digest``: the driver's :func:`~raysplit.models.adapters.base_digest`; a template whose base differs is a
    ``RuntimeError`` naming the source (a changed directory, another library version). Without adapters
    (``adapter.kind: full``) there is nothing to share: see :func:`build_causal_lm`."""
    from .adapters import base_digest, copy_sharing_base

    dev = torch.device(device if device is not None else "cpu")
    key = (config.model_dump_json(), vocab_size, int(seed), bool(fixed_length), str(dev))
    template = _BASES.get(key)
    if template is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            template = build_causal_lm(config, vocab_size=vocab_size, fixed_length=fixed_length)
        if digest is not None and base_digest(template) != digest:
            source = config.pretrained or f"random initial weights, seed {seed}"
            raise RuntimeError(f"model.lm: this process built a frozen base from {source!r} that differs from the "
                               f"driver's (digest {base_digest(template)} != {digest}); every side must load the "
                               f"same base (the same directory and library versions)")
        template = template.to(dev)
        _BASES[key] = template
        while len(_BASES) > _BASES_KEPT:
            _BASES.popitem(last=False)
    else:
        _BASES.move_to_end(key)
    return copy_sharing_base(template)


def save_base_pretrained(model: CausalLM, path: str | os.PathLike) -> None:
    """The frozen base in ``save_pretrained`` layout (safetensors), without its adapters: what every side loads
    (``model.lm.pretrained``). peft's injected layers keep the base weight as ``<module>.base_layer.weight``; the
    saved names are the library's own, so the directory loads as a plain model. Adapters are saved apart
    (:func:`~raysplit.models.adapters.trainable_state`)."""
    state = {key.replace(".base_layer.", "."): value for key, value in model.hf_model.state_dict().items()
             if "lora_" not in key}
    model.hf_model.save_pretrained(str(path), state_dict=state)


# ----------------------------------------------------------------------------------------------------------------
# Checks that name the key
# ----------------------------------------------------------------------------------------------------------------
def resolve_lm_cut(model: CausalLM, cut: int | str | None, key: str = "model.cut") -> int:
    """``model.resolve_cut`` with the config key in the message (null: the model's default cut)."""
    if cut is None:
        return model.default_cut
    try:
        return model.resolve_cut(cut)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def check_context_length(model: CausalLM, context_length: int, key: str = "data.text.context_length") -> None:
    """A context longer than the model's positions is an error naming ``key`` and the model's limit."""
    if context_length > model.max_positions:
        raise ConfigError(f"{key}={context_length} is longer than the model's {model.max_positions} positions "
                          f"({model.family}); lower it or raise model.lm.max_positions")


def check_tokenizer_vocab(model: CausalLM, tokenizer_vocab: int, source: str = "the tokenizer",
                          key: str = "model.lm.vocab_size") -> None:
    """Token ids must index the model's embedding table: a tokenizer with more ids than ``model.vocab_size``
    is an error naming ``key``."""
    if tokenizer_vocab > model.vocab_size:
        raise ConfigError(f"{key}: {source} has {tokenizer_vocab} tokens but the model's vocabulary is "
                          f"{model.vocab_size}; use the model's own tokenizer or a model with a vocabulary of at "
                          f"least {tokenizer_vocab}")


# ----------------------------------------------------------------------------------------------------------------
# Running parts in order; generation
# ----------------------------------------------------------------------------------------------------------------
def compose(parts: Sequence[nn.Module]):
    """``x -> parts[-1](... parts[0](x))``: a split model's parts in the order its payloads travel (client,
    server; or client head, server, client tail for a U-shape)."""
    def run(x):
        for part in parts:
            x = part(x)
        return x
    return run


@torch.no_grad()
def generate(parts: Sequence[nn.Module], prompt_ids: torch.Tensor, max_new_tokens: int, *, context_length: int,
             eos_id: int | None = None, temperature: float = 0.0, top_k: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """A continuation of ``prompt_ids`` ``(B, T)`` through a split model's ``parts`` (see :func:`compose`): each
    step runs the last ``context_length`` tokens through every part (no key/value cache: every part sees exactly
    what a training step sends, and the client keeps its tokens in a U-shape) and appends one token: the most
    likely (``temperature`` 0, greedy) or one drawn from the softmax of ``logits / temperature``, restricted to
    the ``top_k`` most likely where given, with ``generator``. Rows that produced ``eos_id`` keep producing it.
    Train/eval flags are set to eval and restored. Returns ``(B, T + max_new_tokens)``."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    flags = [(m, m.training) for part in parts for m in part.modules()]
    for part in parts:
        part.eval()
    try:
        run = compose(parts)
        ids = prompt_ids
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for _ in range(int(max_new_tokens)):
            logits = run(Tokens(ids[:, -context_length:]))[:, -1].float()
            if top_k is not None:
                kth = logits.topk(min(int(top_k), logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done = done | (nxt == eos_id)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        return ids
    finally:
        for m, flag in flags:
            m.training = flag
