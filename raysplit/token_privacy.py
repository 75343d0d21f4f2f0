"""Privacy of tokens in a split language model (building block: no Ray, no MLflow): what an honest-but-curious
server can read of a client's text from what crosses the cuts of a :class:`~raysplit.models.causal_lm.CausalLM`.

The attacker's knowledge is SplitLLM's (Chen et al., "Unveiling the Vulnerability of Private Fine-Tuning in Split-
Based Frameworks for Large Language Models: A Bidirectionally Enhanced Attack", CCS 2024; code
StupidTrees/SplitLLM): the **public base** (the pretrained weights every side loads, frozen under LoRA; in a run,
the client part as the run started) and **public text**; never the client's adapters, data or labels.

- **Token recovery from the hidden states at the cut** (``privacy.attack``):

  * ``nearest_tokens``: each position's hidden state matched to the nearest row of the public embedding table
    (cosine or L2), after removing the public positional embedding where the family adds one to the residual
    stream (GPT-2's ``wpe``; Llama's positions are rotary, inside each layer). At ``cut: embed`` the hidden state
    *is* the row plus the positional term, so the recovery is exact with no defence; deeper cuts keep the token in
    the residual stream and the match degrades with depth and training (the embedding-inversion baseline SplitLLM
    and the embedding-inversion literature start from).
  * ``train_token_decoder``: a learned inversion, SplitLLM's setting: the attacker encodes public text through the
    public base's client part (through the client's defence too: its kind and parameters are public, Kerckhoffs'
    assumption), and fits a small decoder from each position's hidden state to its token (an MLP over the
    standardized hidden state, cross-entropy, Adam); kept per position and small, so it trains in seconds on a CPU.
    SplitLLM's own inversion model (BiSR's learning-based part) is a small transformer over the whole sequence;
    this is the per-position reduction of it.

  Both are scored by ``token_accuracy``: the fraction of the victim's tokens recovered exactly.

- **Next-token leakage from the returned gradients** (``privacy.label_attack: next_token``), in the U-shape where
  the client's tail is the LM head alone: the gradient the client returns for position ``t`` is
  ``J_t^T W^T (p_t - e_{y_t}) / N`` (``J_t``: the final norm's Jacobian, ``W``: the LM head, ``p_t``: the softmax,
  ``y_t`` the next token), so ``-g_t`` points along the target token's head row. ``next_token_scores`` scores
  every vocabulary entry by the cosine of ``-g_t`` with the public head's rows scaled by the final norm's weight
  (the rows as they reach the cut), the direction scoring of Li et al. 2022 (raysplit/label_privacy.py) with the
  head's rows as the reference gradients of the vocabulary; it ignores the norm's projection and per-token scale
  (cosine absorbs the scale) and the ``W^T p_t`` term, which is small while the softmax is spread (an untrained or
  early model) and grows as the model learns. ``next_token_leak``: top-1 and top-5 accuracy of the recovered next
  tokens.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["embedding_tables", "head_rows", "nearest_tokens", "train_token_decoder", "token_accuracy",
           "next_token_scores", "next_token_leak", "embed_block"]


def _weight(module: nn.Module) -> torch.Tensor:
    """A layer's base weight (peft keeps it as ``base_layer`` where an adapter is injected: the public one)."""
    return getattr(module, "base_layer", module).weight.detach()


def embed_block(part: nn.Module) -> nn.Module:
    """The embedding block of a language model's client part (a :class:`~raysplit.models.UClient`'s head, or a
    plain split's ``nn.Sequential`` of blocks): its first block."""
    seq = getattr(part, "head", part)
    return seq[0]


def embedding_tables(embed: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token embedding table ``(V, D)`` of an embedding block (``GPT2Embed``: ``wte``; ``LlamaEmbed``:
    ``embed_tokens``) and the learned positional table ``(P, D)`` added to the residual stream (GPT-2's ``wpe``;
    None for Llama)."""
    if hasattr(embed, "wte"):
        return _weight(embed.wte), _weight(embed.wpe)
    if hasattr(embed, "embed_tokens"):
        return _weight(embed.embed_tokens), None
    raise TypeError(f"not a language model's embedding block: {type(embed).__name__}")


def head_rows(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's rows ``(V, D)`` and the final norm's weight ``(D,)`` (None where the norm has none) of an
    :class:`~raysplit.models.causal_lm.LMHead`."""
    norm_w = getattr(head.norm, "weight", None)
    return _weight(head.lm_head), (norm_w.detach() if norm_w is not None else None)


@torch.no_grad()
def nearest_tokens(hidden: torch.Tensor, table: torch.Tensor, metric: str = "cosine",
                   positions: torch.Tensor | None = None, chunk: int = 4096) -> torch.Tensor:
    """The token whose row of ``table`` ``(V, D)`` is nearest to each position's hidden state ``hidden``
    ``(B, T, D)`` (``metric``: ``cosine`` or ``l2``), after subtracting ``positions[:T]`` (the public positional
    embedding, where given). Rows are compared ``chunk`` positions at a time. Returns ids ``(B, T)``."""
    if metric not in ("cosine", "l2"):
        raise ValueError(f"metric must be cosine or l2, got {metric!r}")
    h = hidden.detach().float()
    b, t, d = h.shape
    if positions is not None:
        h = h - positions[:t].to(h)
    h = h.reshape(b * t, d)
    tab = table.to(h)
    if metric == "cosine":
        tab = nn.functional.normalize(tab, dim=-1)
    sq = tab.pow(2).sum(-1)
    out = []
    for rows in h.split(chunk):
        if metric == "cosine":
            out.append((nn.functional.normalize(rows, dim=-1) @ tab.T).argmax(-1))
        else:  # argmin ||h - e||^2 = argmin ||e||^2 - 2 h.e
            out.append((sq - 2 * rows @ tab.T).argmin(-1))
    return torch.cat(out).reshape(b, t)


class TokenDecoder(nn.Module):
    """Per position: standardize the hidden state (the attacker's training set's mean and std per feature), then an
    MLP to the vocabulary's logits."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, hidden: int, vocab: int):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        d = mean.numel()
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, vocab))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.mlp((z.float() - self.mean) / self.std)

    @torch.no_grad()
    def tokens(self, z: torch.Tensor) -> torch.Tensor:
        return self(z).argmax(-1)


def train_token_decoder(z: torch.Tensor, ids: torch.Tensor, vocab: int, epochs: int, hidden: int, seed: int,
                        batch: int = 256, lr: float = 3e-3) -> TokenDecoder:
    """The learned inversion's decoder, fitted on the attacker's pairs: hidden states ``z`` ``(N, T, D)`` of public
    text ``ids`` ``(N, T)`` (every position one training pair), cross-entropy over ``vocab`` tokens, Adam at ``lr``
    for ``epochs`` passes in batches of ``batch`` positions; deterministic in ``seed``."""
    zf = z.detach().reshape(-1, z.shape[-1]).float()
    yf = ids.detach().reshape(-1).long()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dec = TokenDecoder(zf.mean(0), zf.std(0).clamp_min(1e-6), hidden, vocab)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(dec.mlp.parameters(), lr=lr)
    for _ in range(epochs):
        for idx in torch.randperm(len(zf), generator=g).split(batch):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(dec(zf[idx]), yf[idx]).backward()
            opt.step()
    return dec.eval()


def token_accuracy(pred: torch.Tensor, ids: torch.Tensor) -> float:
    """The fraction of positions whose recovered token is the true one."""
    return float((pred.reshape(ids.shape) == ids).float().mean())


@torch.no_grad()
def next_token_scores(g: torch.Tensor, rows: torch.Tensor, norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Every vocabulary entry's score as the next token at each position but the last (which has no target), from
    the gradient ``g`` ``(B, T, D)`` the client returned at the tail cut: the cosine of ``-g`` with the LM head's
    ``rows`` ``(V, D)``, each scaled by the final norm's weight ``norm_weight`` where given. Returns
    ``(B, T-1, V)``."""
    ref = rows.float() * (norm_weight.float() if norm_weight is not None else 1.0)
    ref = nn.functional.normalize(ref, dim=-1)
    return nn.functional.normalize(-g[:, :-1].float(), dim=-1) @ ref.T


def next_token_leak(g: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                    norm_weight: torch.Tensor | None = None) -> dict[str, float]:
    """``next_token_leak`` (top-1) and ``next_token_top5``: how often the true next token ``ids[:, t+1]`` is the
    best (among the 5 best) of :func:`next_token_scores` for position ``t``, over the positions whose next token
    is a target (``ids`` the labels: an ``IGNORE_INDEX`` one, a masked E2E prompt token, adds nothing to the loss
    or the gradient there, so it is not scored; nothing where no position is)."""
    from raysplit.lm_metrics import IGNORE_INDEX

    s = next_token_scores(g, rows, norm_weight)
    y = ids[:, 1:].to(s.device).long()
    top = s.topk(min(5, s.shape[-1]), dim=-1).indices
    scored = y != IGNORE_INDEX
    if not bool(scored.any()):
        return {}
    return {"next_token_leak": float((top[..., 0] == y)[scored].float().mean()),
            "next_token_top5": float((top == y[..., None]).any(-1)[scored].float().mean())}
