"""Privacy of tokens in split LoRA fine-tuning (issue 71, item 7, reduced): how much of a client's text an
honest-but-curious server recovers from the hidden states at the cut, and of its next tokens from the gradients the
client returns, against the noise the client adds to its hidden states (FedSEA-LLaMA's defence, as the Gaussian
mechanism so that the accountant states its epsilon).

    .venv/bin/python docs/results/run_llm_privacy.py [--seeds 0 1 2] [--report]

Setting: configs/llm/quickstart.yaml (a tiny GPT-2 with random initial weights, 2 blocks of width 64, a 512-token
BPE, LoRA rank 16; four fortune categories, one client each; SFLV2; U-shaped at cut block1, the server holding
block2, the client the embeddings, block1 and the LM head) reduced to 5 rounds of 5 local steps, the in-process
backend, one torch thread. Each run: ``privacy.defence`` noise with the clip at L2 norm ``CLIP`` per token block
(std ``sigma x CLIP`` per coordinate; the public base's blocks at this cut have a norm of about 2-3, printed by
``--report``), ``privacy.label_attack: next_token``, and one token attack at every evaluation (victims 0 and 1, 32
training blocks each): ``nearest_embedding`` (cosine, the public positions removed) or ``token_inversion`` (a
decoder trained on the test split's last 32 blocks through the public base and the same noise). A run's numbers
are its last round's. Runs are computed in this process, cached as JSON under ``--out`` (default
docs/results/.llm_privacy_runs/, ignored) with a committed record each (docs/results/records/llm_privacy_runs/),
from which ``--report`` prints the table without running anything.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _runs import ROOT, keep, median_range, named, restore, spec_digest

HERE = Path(__file__).resolve().parent
CONFIG = ROOT / "configs" / "llm" / "quickstart.yaml"
EXPERIMENT = "llm-privacy"
CLIP = 4.0
STDS = (0.0, 0.01, 0.03, 0.1)  # noise std per coordinate; the embedding rows' is 0.02 (GPT-2's init)
COMMON = {"train.rounds": 5, "train.local_steps": 5, "runtime.backend": "local", "runtime.torch_threads": 1,
          "tracking.enabled": False, "tracking.progress": False, "privacy.label_attack": {"kind": "next_token"}}
ATTACKS = {"nearest_embedding": {"kind": "nearest_embedding", "victims": 2, "samples": 32},
           "token_inversion": {"kind": "token_inversion", "victims": 2, "samples": 32, "aux_size": 32}}
KEYS = ("eval/perplexity", "privacy/token_recovery", "privacy/next_token_leak", "privacy/next_token_top5",
        "privacy/epsilon")


def overrides(attack: str, std: float, seed: int) -> dict:
    defence = ({"kind": "noise", "sigma": std / CLIP, "clip": CLIP} if std > 0 else {"kind": "none"})
    return {**COMMON, "seed": seed, "privacy.defence": defence, "privacy.attack": ATTACKS[attack]}


def label(attack: str, std: float, seed: int) -> str:
    return f"{attack}_std{std:g}_s{seed}"


def run_one(out: Path, attack: str, std: float, seed: int) -> dict:
    from raysplit.config import load_config
    from raysplit.experiment import run_experiment

    over = overrides(attack, std, seed)
    spec = {"config": str(CONFIG.relative_to(ROOT)), "overrides": over}
    path = out / f"{label(attack, std, seed)}.json"
    if restore(path, digest=spec_digest(spec)):
        return named(json.loads(path.read_text()))
    final = run_experiment(load_config(CONFIG, over))
    res = {k: float(final[k]) for k in KEYS if k in final}
    keep(path, EXPERIMENT, label(attack, std, seed), spec, res)
    return res


def block_norms() -> str:
    """The L2 norm of the public base's hidden states per token block at the cut (what the clip bounds)."""
    import torch

    from raysplit.config import load_config
    from raysplit.experiment import prepare

    p = prepare(load_config(CONFIG, overrides("nearest_embedding", 0.0, 0)))
    facts = p.inputs.plan.model
    from raysplit.models.tiers import client_part
    from raysplit.runtime import transport

    part = client_part(facts.build(), facts.cut, facts.tail_cut)
    part.load_state_dict(transport.unpack_state(p.inputs.client_init))
    part.eval()
    with torch.no_grad():
        z = part(torch.as_tensor(p.inputs.train_data["x"][:256]))
    n = z.reshape(len(z), -1).norm(dim=1)
    return (f"public base at cut block1: block norm median {n.median():.2f} [min {n.min():.2f}, max {n.max():.2f}] "
            f"over 256 training blocks; coordinate std {z.std():.4f}")


def report(out: Path, seeds: list[int]) -> None:
    print("| noise std | sigma (clip 4) | epsilon (delta 1e-5) | perplexity | tokens recovered, nearest embedding | "
          "tokens recovered, learned inversion | next token top-1 from gradients | top-5 |")
    print("|---|---|---|---|---|---|---|---|")
    for std in STDS:
        got = {a: [r for s in seeds if (r := _cached(out, a, std, s)) is not None] for a in ATTACKS}
        both = got["nearest_embedding"] + got["token_inversion"]
        if not both:
            continue

        def col(rows, k, fmt=".3f"):
            v = [r[k] for r in rows if k in r]
            return median_range(v, fmt) if v else "-"

        eps = col(both, "privacy/epsilon", ".3g") if std > 0 else "inf (no noise)"
        print(f"| {std:g} | {std / CLIP:g} | {eps} | {col(both, 'eval/perplexity', '.1f')} | "
              f"{col(got['nearest_embedding'], 'privacy/token_recovery')} | "
              f"{col(got['token_inversion'], 'privacy/token_recovery')} | "
              f"{col(both, 'privacy/next_token_leak')} | {col(both, 'privacy/next_token_top5')} |")
    print(f"\n{block_norms()}")


def _cached(out: Path, attack: str, std: float, seed: int) -> dict | None:
    path = out / f"{label(attack, std, seed)}.json"
    spec = {"config": str(CONFIG.relative_to(ROOT)), "overrides": overrides(attack, std, seed)}
    return named(json.loads(path.read_text())) if restore(path, digest=spec_digest(spec)) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=HERE / ".llm_privacy_runs")
    ap.add_argument("--report", action="store_true", help="print the table from the caches and records only")
    args = ap.parse_args()
    if not args.report:
        for seed in args.seeds:
            for std in STDS:
                for attack in ATTACKS:
                    res = run_one(args.out, attack, std, seed)
                    print(label(attack, std, seed), {k: round(v, 4) for k, v in res.items()}, flush=True)
    report(args.out, args.seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
