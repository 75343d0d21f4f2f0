"""Language-model metrics (building block: no Ray, no MLflow): per-token loss and perplexity on held-out text,
generation from text prompts through a split model's parts, and the scores of generated text (BLEU from
``sacrebleu``, ROUGE-L from ``rouge-score``: the maintained packages, not a reimplementation).

The loss is the mean negative log-likelihood of every next token a block predicts (the logits at position ``t``
score token ``t + 1``; a padded target is not counted), so perplexity is ``exp`` of it over all tokens of the
evaluation set together, not the mean of per-batch perplexities. ``tokens`` is how many targets were counted.

The targets are the labels ``y`` a batch carries, the Hugging Face convention: the block's own ids, shifted here
(``y[:, 1:]``), where a position set to :data:`IGNORE_INDEX` (-100) is no target. E2E's meaning representations
are so masked (``data.text.loss_on: completion``, :mod:`raysplit.data.text`): every loss, per-sample loss,
perplexity, next-token accuracy and ``tokens`` here counts the completion's targets only. Elsewhere no position is
masked and nothing changes.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from raysplit.data.text import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "token_nll", "lm_loss", "lm_sample_losses", "evaluate_lm", "lm_eval_metrics",
           "generate_text", "generation_scores", "throughput_metrics"]


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of next-token NLL, number of targets)`` of a batch: logits ``(B, T, V)``, labels ``(B, T)`` (the
    ids; :data:`IGNORE_INDEX` where a position is no target), mask ``(B, T)`` (1 = token; null: all). Both stay on
    the logits' device (nothing is read back here)."""
    targets = input_ids[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none",
                          ignore_index=IGNORE_INDEX)  # 0 where ignored
    scored = targets.flatten() != IGNORE_INDEX
    if attention_mask is None:
        return nll.sum(), scored.sum()
    keep = attention_mask[:, 1:].flatten().to(nll.dtype) * scored.to(nll.dtype)
    return (nll * keep).sum(), keep.sum().to(torch.long)


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
            ) -> torch.Tensor:
    """The causal-LM training loss: the mean next-token NLL over the batch's targets (those not
    :data:`IGNORE_INDEX`; 0 where there are none)."""
    total, count = token_nll(logits, input_ids, attention_mask)
    return total / count.clamp(min=1)


def lm_sample_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-sample losses ``(B,)`` of a batch of fixed-length blocks: each block's mean next-token NLL over its
    targets (its ``T - 1`` next tokens but those :data:`IGNORE_INDEX`; 0 for a block with none). Unmasked blocks
    of one length count the same targets each, so the plain mean of these is :func:`lm_loss` (up to float
    rounding); a weighted mean weighs whole blocks (CycleSL's client-size weights). Masked blocks (E2E's
    completions) count their own numbers of targets, so the plain mean then weighs each block's mean alike, where
    :func:`lm_loss` weighs every target alike: a block's loss does not depend on the batch it is in."""
    targets = input_ids[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none",
                          ignore_index=IGNORE_INDEX).view(targets.shape)  # 0 where ignored
    return nll.sum(dim=1) / (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)


@torch.no_grad()
def evaluate_lm(forward: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[torch.Tensor]) -> dict:
    """``{"loss", "perplexity", "tokens"}`` of ``forward`` (token ids -> logits: a model, or a split model's
    parts composed, :func:`raysplit.models.causal_lm.compose`) over ``batches`` of fixed-length blocks (each the
    ids, or ``(ids, labels)`` with :data:`IGNORE_INDEX` where a position is no target); the sums stay on the
    device and are read once at the end."""
    total = count = None
    for batch in batches:
        ids, labels = batch if isinstance(batch, (tuple, list)) else (batch, batch)
        s, n = token_nll(forward(ids), labels)
        total = s if total is None else total + s
        count = n if count is None else count + n
    if count is None or int(count) == 0:
        raise ValueError("evaluate_lm: no tokens to evaluate")
    loss = float(total) / int(count)
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(count)}


def lm_eval_metrics(targets, predictions, nll_sum: float) -> dict:
    """A run's evaluation of a language model from the runtime's evaluation loop (every next token of the test
    blocks that is a target, :mod:`raysplit.runtime.evaluation`: ``targets``, the most likely tokens
    ``predictions``, the summed NLL): ``loss`` (per token),
    ``perplexity`` (``exp`` of it), ``next_token_accuracy`` and ``tokens``. No per-label metrics: the labels are a
    vocabulary."""
    import numpy as np

    targets, predictions = np.asarray(targets), np.asarray(predictions)
    n = len(targets)
    if n == 0:
        raise ValueError("lm_eval_metrics: no tokens to evaluate")
    loss = float(nll_sum) / n
    return {"loss": loss, "perplexity": math.exp(loss),
            "next_token_accuracy": float((targets == predictions).mean()), "tokens": n}


def generate_text(parts, tokenizer, prompts, *, max_new_tokens: int, context_length: int, greedy: bool = True,
                  temperature: float = 1.0, top_k: int | None = None, seed: int = 0, device="cpu") -> list[str]:
    """The continuation of each of ``prompts`` (text) through a split model's ``parts`` in the order payloads
    travel (:func:`raysplit.models.causal_lm.generate`: no cache, every part sees what a training step sends):
    each prompt tokenized by ``tokenizer`` (a :class:`~raysplit.data.text.TextTokenizer`) where this runs, then
    ``max_new_tokens`` tokens, greedy or drawn (``temperature``, ``top_k``; a generator seeded with ``seed``, one
    prompt after the other), cut at the first end-of-text token and decoded. Prompts are run one at a time (a
    fixed-length model takes no padding); an empty prompt starts from the end-of-text token."""
    from raysplit.models.causal_lm import generate

    gen = None
    if not greedy:
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed))
    out = []
    for text in prompts:
        ids = tokenizer.encode(text)[-context_length:] or [tokenizer.eos_id]
        prompt = torch.tensor([ids], dtype=torch.long, device=device)
        new = generate(parts, prompt, max_new_tokens, context_length=context_length, eos_id=tokenizer.eos_id,
                       temperature=0.0 if greedy else float(temperature), top_k=top_k, generator=gen)[0, len(ids):]
        new = new.tolist()
        if tokenizer.eos_id in new:
            new = new[:new.index(tokenizer.eos_id)]
        out.append(tokenizer.decode(new))
    return out


def generation_scores(hypotheses, references) -> dict:
    """``{"bleu", "rouge_l"}`` of generated texts against their references (one list of references per
    hypothesis, any number each, as E2E groups an MR's references): corpus BLEU from ``sacrebleu`` (its default
    13a tokenisation, 0-100) and ROUGE-L F1 from ``rouge-score`` (the best over a hypothesis's references, as
    the E2E metrics take it; averaged over hypotheses; 0-1)."""
    import sacrebleu
    from rouge_score import rouge_scorer

    hypotheses = [str(h) for h in hypotheses]
    references = [list(r) for r in references]
    if len(hypotheses) != len(references) or not hypotheses or any(not r for r in references):
        raise ValueError("generation_scores: one non-empty list of references per hypothesis")
    width = max(len(r) for r in references)
    streams = [[r[k] if k < len(r) else None for r in references] for k in range(width)]  # sacrebleu: None = none
    bleu = sacrebleu.corpus_bleu(hypotheses, streams).score
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rouge = [scorer.score_multi(r, h)["rougeL"].fmeasure for h, r in zip(hypotheses, references)]
    return {"bleu": float(bleu), "rouge_l": float(sum(rouge) / len(rouge))}


def throughput_metrics(tokens: int, wall_seconds: float, bytes_total: float) -> dict:
    """A language model's round by the token: ``train_tokens`` (every token of the blocks its clients trained
    on), ``tokens_per_s`` (over the round's wall-clock seconds) and ``bytes_per_token`` (the round's bytes up and
    down over its tokens). Nothing where no token was trained. These count the tokens the model runs on (a block's
    every position: what the compute and the hidden states crossing the cut scale with), masked ones included
    (``data.text.loss_on: completion``): fewer of them are targets of the loss (``eval/tokens`` counts those)."""
    if tokens <= 0:
        return {}
    out = {"train_tokens": int(tokens), "bytes_per_token": float(bytes_total) / tokens}
    if wall_seconds > 0:
        out["tokens_per_s"] = tokens / wall_seconds
    return out
