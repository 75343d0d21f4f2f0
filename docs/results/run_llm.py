"""The language-model study (issue 71; docs/results/llm.md): the split families against federated LoRA (FedAvg of
the whole adapted model) and centralised LoRA on Debian's fortunes, a tiny GPT-2 with LoRA (configs/llm/families.yaml:
2 decoder blocks, width 64, random initial weights, four clients, one per category), perplexity per round.

    .venv/bin/python docs/results/run_llm.py [--seeds 0 1 2] [--jobs 1] [--dry-run]

Arms, each a full raysplit run logged to MLflow (experiment llm-families in ./mlflow.db), one per method on the same
config and batches: U-shaped (the clients keep the tokens) for SplitNN, PSL, SFLV1/V2/V3; the plain split (the server
holds the head and receives the targets) for MiniBatch-SFL and the CycleSL family, whose server trains on pooled
batches and needs their targets, and for SplitLoRA as its paper runs it (server-side copies averaged, client adapters
averaged every round). It prints, per arm (median [min, max] over seeds), the final perplexity, the simulated time,
the client FLOPs and the bytes up and down of the last round (as the run logs them; medians), and the median perplexity at every fifth
round; then SplitLoRA's two registry measures (docs/results/claims.yaml): its final perplexity over centralised
LoRA's, and the simulated time it saves to the lowest perplexity both it and federated LoRA reach (percent of
federated LoRA's; claims.record_value's rule), paired by seed. ``--report`` prints the same from the caches and
records, running nothing.
``--dry-run`` validates every arm's config, prepares the first seed's as a run would (data, tokenizer, model: no
actor, no training; a refusal such as a pooled method's U-shape shows there) and prints the arms, running nothing.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from _runs import ROOT, Run, common_target, median_range, restored, scores, study, to_target

CONFIG = ROOT / "configs" / "llm" / "families.yaml"
PLAIN = {"model.lm.split": "plain"}
ARMS = {"centralised": {"algorithm.name": "centralised"},
        "fedavg": {"algorithm.name": "fedavg"},
        "splitlora": {"algorithm.name": "splitlora", **PLAIN},
        "sflv1": {"algorithm.name": "sflv1"},
        "sflv2": {"algorithm.name": "sflv2"},
        "sflv3": {"algorithm.name": "sflv3"},
        "psl": {"algorithm.name": "psl"},
        "splitnn": {"algorithm.name": "splitnn"},
        "minibatch_sfl": {"algorithm.name": "minibatch_sfl", **PLAIN},
        "cyclesfl": {"algorithm.name": "cyclesfl", **PLAIN},
        "cyclepsl": {"algorithm.name": "cyclepsl", **PLAIN}}
KEYS = ("eval/perplexity", "time/sim", "comm/bytes_up", "comm/bytes_down")
OUT = ROOT / "outputs" / "studies" / "llm"
EVERY = 5  # the rounds the curve table shows


CORE = ("centralised", "fedavg", "splitlora")  # SplitLoRA's registry rows: run first, on every seed


def runs(seeds) -> list[tuple[str, int, Run]]:
    def run(arm, seed):
        return (arm, seed, Run(CONFIG, {**ARMS[arm], "seed": seed}, f"{arm} seed {seed}",
                               OUT / f"llm_{arm}_s{seed}.json", keys=KEYS))
    # the registry's arms on every seed first, then the others seed by seed: a study cut short keeps whole seeds
    return ([run(arm, seed) for seed in seeds for arm in CORE]
            + [run(arm, seed) for seed in seeds for arm in ARMS if arm not in CORE])


def perplexities(res: dict) -> dict[int, float]:
    """A run's perplexity at every evaluated round (``_runs.scores``: the negative perplexity from its history)."""
    return {rnd: -score for rnd, _, score in scores(res)}


def claims(by_arm: dict) -> list[str]:
    """SplitLoRA's registry measures, paired by seed: final perplexity over centralised's, and simulated time to
    the perplexity both reach over federated LoRA's."""
    lines = []
    sl, cen, fed = (dict(by_arm.get(k, [])) for k in ("splitlora", "centralised", "fedavg"))
    seeds = sorted(set(sl) & set(cen))
    if seeds:
        r = [sl[s]["eval/perplexity"] / cen[s]["eval/perplexity"] for s in seeds]
        lines.append("splitlora / centralised final perplexity: " + ", ".join(f"seed {s} {x:.4f}" for s, x in zip(seeds, r)))
    seeds = sorted(set(sl) & set(fed))
    if seeds:
        tgt = {s: common_target([sl[s], fed[s]]) for s in seeds}  # the negative of the lowest perplexity both reach
        t = {s: (to_target(sl[s], tgt[s])[1], to_target(fed[s], tgt[s])[1]) for s in seeds}
        r = [100 * (1 - t[s][0] / t[s][1]) for s in seeds]
        each = [f"seed {s} {x:+.1f} ({t[s][0]:.1f} s vs {t[s][1]:.1f} s to {-tgt[s]:.1f})" for s, x in zip(seeds, r)]
        lines.append("time splitlora saves to the common perplexity, % of fedavg's: " + ", ".join(each))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--report", action="store_true", help="print the tables from the caches and records only")
    a = ap.parse_args()
    todo = runs(a.seeds)
    if a.dry_run:  # every arm's config through prepare(), as a run starts it (no actor): a refusal shows here
        from raysplit.config import load_config
        from raysplit.errors import ConfigError
        from raysplit.experiment import prepare

        refused = 0
        for arm, seed, r in todo:
            cfg = load_config(r.config, r.overrides)
            state = "validated"
            try:
                if seed == a.seeds[0]:  # the first seed's: the others differ by the seed only
                    prepare(cfg)
                    state = "prepared"
            except ConfigError as e:
                refused += 1
                state = f"REFUSED: {e}"
            print(f"{r.label:24s} {cfg.algorithm.name} split={cfg.model.lm.split}: {state}")
        sys.exit(1 if refused else 0)
    if a.report:
        import json

        from _runs import named
        results = [named(json.loads(restored(r.out).read_text())) if restored(r.out).is_file() else None
                   for *_, r in todo]
    else:
        results = study("llm-families", [r for *_, r in todo], a.jobs, metric="eval/perplexity")
    by_arm: dict[str, list] = {}
    for (arm, seed, _), res in zip(todo, results):
        if res is not None:
            by_arm.setdefault(arm, []).append((seed, res))
    rounds = max(h["round"] for v in by_arm.values() for _, r in v for h in r["history"])
    marks = list(range(EVERY, rounds + 1, EVERY))
    cols = ["perplexity", "time/sim, 20 rounds (s)", "client GFLOPs a round", "MB up / down a round"]
    print("| arm | seeds | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 2) + "|")
    for arm, got in by_arm.items():
        rs = [r for _, r in got]
        cells = [median_range([r["eval/perplexity"] for r in rs], ".1f"),
                 median_range([r["time/sim"] for r in rs], ".1f"),
                 f"{np.median([r['compute/client_flops'] / 1e9 for r in rs]):.1f}",  # medians: nearly constant
                 f"{np.median([r['comm/bytes_up'] / 1e6 for r in rs]):.1f} / "
                 f"{np.median([r['comm/bytes_down'] / 1e6 for r in rs]):.1f}"]
        print(f"| {arm} | {len(rs)} | " + " | ".join(cells) + " |")
    print("\n| arm | " + " | ".join(f"round {m}" for m in marks) + " |\n" + "|---" * (len(marks) + 1) + "|")
    for arm, got in by_arm.items():
        cells = [f"{np.median([perplexities(r)[m] for _, r in got]):.0f}" for m in marks]
        print(f"| {arm} | " + " | ".join(cells) + " |")
    print()
    print("\n".join(claims(by_arm)))


if __name__ == "__main__":
    main()
