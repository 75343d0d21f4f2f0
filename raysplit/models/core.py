"""Core of the model zoo: :class:`SplitModel`, the model registry and small shared layers.

A :class:`SplitModel` is an ordered list of blocks. Cut index ``k`` puts ``blocks[:k]`` on the client and
``blocks[k:]`` on the server, so the valid cuts are ``1 .. len(blocks) - 1`` (both sides non-empty). A cut is
named after the last client block (``"conv2"`` means "conv2 is the last block on the client"); models may add
aliases that the papers use (``"L2"`` for GAS, ``"layer1"`` for ResNets, ...).

This module knows nothing about Ray, MLflow or Tune.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import OrderedDict
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "SplitModel",
    "UClient",
    "end_to_end",
    "ModelInfo",
    "MODELS",
    "register_model",
    "build_model",
    "count_parameters",
    "param_bytes",
    "Residual",
    "LastStepLSTM",
    "infer_output_shape",
    "flat_dim",
]


# ----------------------------------------------------------------------------------------------------------------
# Small shared layers
# ----------------------------------------------------------------------------------------------------------------
class Residual(nn.Module):
    """``x + body(x)``: a residual block kept as ONE block so that no cut falls inside the skip connection."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class LastStepLSTM(nn.Module):
    """A batch-first (multi-layer) LSTM that returns only the last time step's output, shape ``(B, hidden)``.

    This is what LEAF/CycleSL's Shakespeare client does (``x, _ = lstm(x); h = x[:, -1, :]``); returning a
    plain tensor (not the ``(output, (h, c))`` tuple) is what lets the LSTM be a block in a Sequential.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 2) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size=input_size, hidden_size=hidden_size, num_layers=num_layers,
                            batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return out[:, -1, :]


class ProjectionHead(nn.Module):
    """Semi-SFL's projection head (``ProjectionHead('mlp')``): ``Linear(d, d) -> ReLU -> Linear(d, out)`` on a
    flattened embedding; the caller L2-normalises."""

    def __init__(self, dim: int, out: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, out))

    def forward(self, x):
        return self.net(x)


@torch.no_grad()
def infer_output_shape(module: nn.Module, input_shape: Sequence[int], *, dtype=torch.float32) -> tuple[int, ...]:
    """Shape (without the batch dimension) of ``module``'s output for one input of ``input_shape``.

    Runs one zero input through the module in eval mode (BatchNorm uses its running stats, Dropout is off, so no
    state changes and no random numbers are drawn) and restores each submodule's train/eval flag afterwards.
    Used by builders to size the first Linear layer after a Flatten for a given input size.
    """
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        out = module(torch.zeros((1, *input_shape), dtype=dtype))
    except RuntimeError as exc:  # e.g. the input is too small for the pooling layers
        raise ValueError(f"input_shape {tuple(input_shape)} does not fit this model: {exc}") from exc
    finally:
        for m, flag in flags:
            m.training = flag
    return tuple(out.shape[1:])


def flat_dim(layers: Sequence[nn.Module], input_shape: Sequence[int]) -> int:
    """Number of features after flattening the output of ``layers`` (run in order) for ``input_shape``."""
    n = 1
    for s in infer_output_shape(nn.Sequential(*layers), input_shape):
        n *= s
    return n


# ----------------------------------------------------------------------------------------------------------------
# SplitModel
# ----------------------------------------------------------------------------------------------------------------
class UClient(nn.Module):
    """The client's part of a U-shaped split: its first blocks (``head``, what ``forward`` runs: the activation it
    sends) and its last blocks (``tail``: from the middle's output to the logits, where the loss and the labels
    stay). One module, so its weights, optimizer state, averaging and hand-over carry both."""

    def __init__(self, head: nn.Module, tail: nn.Module):
        super().__init__()
        self.head, self.tail = head, tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def end_to_end(client: nn.Module, server: nn.Module, encoder: nn.Module | None = None) -> Callable:
    """The logits of inputs through a client part (``encoder``: the module that encodes, default the client's
    own) and a server part, and through the client's tail where the split is U-shaped (:class:`UClient`)."""
    enc = encoder if encoder is not None else client
    tail = client.tail if isinstance(client, UClient) else None
    if tail is None:
        return lambda x: server(enc(x))
    return lambda x: tail(server(enc(x)))


class SplitModel(nn.Module):
    """An ordered list of blocks with named cut points.

    Cut index ``k`` means ``blocks[:k]`` on the client and ``blocks[k:]`` on the server; valid cuts are
    ``1 .. len(blocks) - 1``. A cut's name is the name of the last client block; ``aliases`` add extra names
    (mapping alias -> block name or cut index).

    Parts returned by :meth:`split` / :meth:`split3` / :meth:`segment` are ``nn.Sequential`` objects holding the
    SAME module objects as this model (no copies): training a part trains the full model. Each part names its
    children by their index in the full model (``"0", "1", ...`` for the client, ``"k", "k+1", ...`` for the
    server), so ``"blocks." + key`` of a part's ``state_dict`` key is the full model's key.

    Attributes set by :func:`build_model`: ``name``, ``input_shape``, ``input_kind`` ("image" | "tokens"),
    ``default_cut`` (an index) and, for token models, ``vocab_size``.
    """

    def __init__(
        self,
        blocks: Sequence[tuple[str, nn.Module]] | Mapping[str, nn.Module],
        aliases: Mapping[str, str | int] | None = None,
        *,
        name: str = "",
        input_shape: Sequence[int] | None = None,
        input_kind: str = "image",
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        items = list(blocks.items()) if isinstance(blocks, Mapping) else list(blocks)
        if len(items) < 2:
            raise ValueError("a SplitModel needs at least 2 blocks (one per side)")
        names = [str(n) for n, _ in items]
        if len(set(names)) != len(names):
            raise ValueError(f"block names must be unique, got {names}")
        for n in names:
            if n.isdigit():
                raise ValueError(f"block name {n!r} is all digits; it would be confused with a cut index")
        self.blocks = nn.ModuleList([m for _, m in items])
        self.block_names: list[str] = names
        self.name = name
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.input_kind = input_kind
        self.vocab_size = vocab_size
        self.default_cut: int | None = None

        self._cuts: dict[str, int] = {names[k - 1]: k for k in range(1, len(names))}
        for alias, target in (aliases or {}).items():
            if alias.isdigit():
                raise ValueError(f"alias {alias!r} is all digits")
            if alias in names:
                raise ValueError(f"alias {alias!r} is already a block name")
            if alias in self._cuts:
                raise ValueError(f"duplicate alias {alias!r}")
            self._cuts[alias] = self.resolve_cut(target)

    # -- running ---------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def __len__(self) -> int:
        return len(self.blocks)

    # -- cuts ------------------------------------------------------------------------------------------------
    def cut_points(self) -> dict[str, int]:
        """All valid cuts: name -> index. Block names first (in order), then aliases."""
        return dict(self._cuts)

    def _describe_cuts(self) -> str:
        by_index: dict[int, list[str]] = {}
        for n, k in self._cuts.items():
            by_index.setdefault(k, []).append(n)
        return ", ".join(f"{k} ({' / '.join(by_index[k])})" for k in sorted(by_index))

    def resolve_cut(self, cut: int | str) -> int:
        """Turn a cut (index, digit string, block name or alias) into an index in ``1 .. len(blocks) - 1``.

        Raises ``ValueError`` naming every valid cut (index and names) for anything else.
        """
        n = len(self.blocks)
        index: int | None = None
        if isinstance(cut, str):
            s = cut.strip()
            if s in self._cuts:
                return self._cuts[s]
            if s.lstrip("-").isdigit():
                index = int(s)
        elif not isinstance(cut, bool):
            try:
                index = operator.index(cut)
            except TypeError:
                index = None
        if index is not None and 1 <= index <= n - 1:
            return index
        label = f" of model {self.name!r}" if self.name else ""
        raise ValueError(
            f"invalid cut {cut!r}{label}: a cut is an index in 1..{n - 1} (blocks[:k] on the client) or a name; "
            f"valid cuts: {self._describe_cuts()}"
        )

    # -- parts -----------------------------------------------------------------------------------------------
    def segment(self, start: int, end: int) -> nn.Sequential:
        """``blocks[start:end]`` as a Sequential sharing the module objects; children named by full-model index."""
        if not 0 <= start < end <= len(self.blocks):
            raise ValueError(f"bad segment [{start}, {end}) for a model with {len(self.blocks)} blocks")
        return nn.Sequential(OrderedDict((str(i), self.blocks[i]) for i in range(start, end)))

    def split(self, cut: int | str) -> tuple[nn.Sequential, nn.Sequential]:
        """``(client_part, server_part)``; ``server_part(client_part(x))`` equals ``self(x)``."""
        k = self.resolve_cut(cut)
        return self.segment(0, k), self.segment(k, len(self.blocks))

    def split3(self, cut_a: int | str, cut_b: int | str) -> tuple[nn.Sequential, nn.Sequential, nn.Sequential]:
        """Three parts (client, server body, server head) for Hydra-style training; needs ``cut_a < cut_b``."""
        a, b = self.resolve_cut(cut_a), self.resolve_cut(cut_b)
        if not a < b:
            raise ValueError(f"split3 needs cut_a < cut_b, got {cut_a!r} -> {a} and {cut_b!r} -> {b}")
        return self.segment(0, a), self.segment(a, b), self.segment(b, len(self.blocks))

    def split_u(self, cut: int | str, tail_cut: int | str) -> tuple["UClient", nn.Sequential]:
        """A U-shaped split: ``(client, middle)``, the client holding ``blocks[:cut]`` and ``blocks[tail_cut:]``
        (:class:`UClient`), the server the middle; ``client.tail(middle(client(x)))`` equals ``self(x)``."""
        head, middle, tail = self.split3(cut, tail_cut)
        return UClient(head, tail), middle

    # -- helpers ---------------------------------------------------------------------------------------------
    def example_input(self, batch_size: int = 2, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """A random input batch of the model's input shape (floats for images, token ids for token models)."""
        if self.input_shape is None:
            raise ValueError("input_shape is unknown; build the model with build_model()")
        if self.input_kind == "tokens":
            if self.vocab_size is None:
                raise ValueError("token model without vocab_size")
            return torch.randint(0, self.vocab_size, (batch_size, *self.input_shape), generator=generator)
        return torch.randn((batch_size, *self.input_shape), generator=generator)

    @torch.no_grad()
    def activation_shape(self, cut: int | str) -> tuple[int, ...]:
        """Shape (without batch) of what the client sends at ``cut`` for the model's input shape."""
        client, _ = self.split(cut)
        if self.input_kind == "tokens":
            flags = [(m, m.training) for m in client.modules()]
            client.eval()
            try:
                return tuple(client(torch.zeros((1, *self.input_shape), dtype=torch.long)).shape[1:])
            finally:
                for m, flag in flags:
                    m.training = flag
        return infer_output_shape(client, self.input_shape)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, cuts={self._describe_cuts()}"


# ----------------------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """One registered model. ``builder(num_classes=..., input_shape=..., **kwargs) -> SplitModel``."""

    name: str
    builder: Callable[..., SplitModel]
    description: str
    default_input_shape: tuple[int, ...]
    input_kind: str
    default_cut: int | str


MODELS: dict[str, ModelInfo] = {}


def register_model(name: str, *, input_shape: Sequence[int], input_kind: str = "image",
                   default_cut: int | str, description: str) -> Callable:
    """Decorator registering ``builder(num_classes, input_shape, **kwargs) -> SplitModel`` under ``name``."""
    if input_kind not in ("image", "tokens"):
        raise ValueError(f"input_kind must be 'image' or 'tokens', got {input_kind!r}")

    def deco(builder: Callable[..., SplitModel]) -> Callable[..., SplitModel]:
        if name in MODELS:
            raise ValueError(f"model {name!r} is already registered")
        MODELS[name] = ModelInfo(name=name, builder=builder, description=description,
                                 default_input_shape=tuple(input_shape), input_kind=input_kind,
                                 default_cut=default_cut)
        return builder

    return deco


def build_model(name: str, num_classes: int, input_shape: Sequence[int] | None = None, **kwargs: Any) -> SplitModel:
    """Build registered model ``name`` with ``num_classes`` outputs (logits) for inputs of ``input_shape``.

    ``input_shape`` defaults to the model's ``default_input_shape``: ``(C, H, W)`` for images, ``(seq_len,)`` for
    tokens. Seeding (``torch.manual_seed``) is the caller's job. Unknown ``name`` -> ``ValueError`` listing the
    registered names.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; registered models: {', '.join(sorted(MODELS))}")
    info = MODELS[name]
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    shape = tuple(int(s) for s in (input_shape if input_shape is not None else info.default_input_shape))
    if len(shape) != len(info.default_input_shape):
        raise ValueError(f"model {name!r} expects input_shape like {info.default_input_shape}, got {shape}")
    model = info.builder(num_classes=num_classes, input_shape=shape, **kwargs)
    model.name = name
    model.input_shape = shape
    model.input_kind = info.input_kind
    model.num_classes = num_classes
    model.default_cut = model.resolve_cut(info.default_cut)
    return model


# ----------------------------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------------------------
def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def count_parameters(module: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter elements (each shared parameter counted once)."""
    return sum(p.numel() for p in _unique(module.parameters()) if p.requires_grad or not trainable_only)


def param_bytes(module: nn.Module, *, include_buffers: bool = False) -> int:
    """Bytes of the module's parameters (optionally plus buffers such as BatchNorm running stats, i.e. roughly
    what a ``state_dict`` upload costs)."""
    tensors = list(_unique(module.parameters()))
    if include_buffers:
        tensors += _unique(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
