"""The study of clients with their own cuts on the language-model corpus (issue 72, item 7; configs/tiers/llm.yaml):
a tiny U-shaped GPT-2 with LoRA on Debian's fortunes, SFLV1, 8 clients on the clock's heterogeneous profiles.

    .venv/bin/python docs/results/run_tiers_lm.py [--seeds 0 1 2] [--jobs 1] [--backend local] [--dry-run]

Arms, each a full raysplit run logged to MLflow (experiment tiers-llm in ./mlflow.db): every client at block1,
block2 or block3 (uniform), two tiers (block1, block3; the faster half deep: ``tier_order: speed``), whose mean
client holds two decoder blocks like the uniform block2 (equal mean client compute), and the same two tiers with
the shallow tier's LoRA rank lowered to 2 (SplitFT, arXiv 2604.26388, lowers the rank of weak clients' adapters;
ranks aggregate zero-padded, raysplit/runtime/tiered.py). It prints, per arm (median [min, max] over seeds), the
final perplexity, each tier's, the client FLOPs of the last round, the bytes up (all, and the activations alone)
and the simulated time. ``--dry-run`` validates every arm's config and prints the arms, running nothing.
"""

from __future__ import annotations

import argparse

from _runs import ROOT, Run, median_range, study

CONFIG = ROOT / "configs" / "tiers" / "llm.yaml"
UNIFORM = {"model.tiers": None}
ARMS = {"uniform block1": {**UNIFORM, "model.cut": "block1"},
        "uniform block2": {**UNIFORM, "model.cut": "block2"},
        "uniform block3": {**UNIFORM, "model.cut": "block3"},
        "tiers block1+block3": {},
        "tiers, shallow rank 2": {"model.tiers": [{"cut": "block1", "share": 0.5, "rank": 2},
                                                  {"cut": "block3", "share": 0.5}]}}
# the arms at equal mean client compute first, the brackets after (a study cut short keeps what it ran)
RUN_ORDER = ("uniform block2", "tiers block1+block3", "tiers, shallow rank 2", "uniform block3", "uniform block1")
KEYS = ("eval/perplexity", "eval/tier0/perplexity", "eval/tier1/perplexity", "compute/client_flops",
        "comm/bytes_up", "comm/bytes_up_activations", "time/sim")


def runs(seeds, backend, out_dir) -> list[tuple[str, int, Run]]:
    return [(arm, seed, Run(CONFIG, {**over, "seed": seed, "runtime.backend": backend}, f"{arm} seed {seed}",
                            out_dir / f"lm_{arm.replace(' ', '_').replace(',', '').replace('+', '_')}_s{seed}.json"))
            for arm in RUN_ORDER for over in [ARMS[arm]] for seed in seeds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--backend", default="local")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    todo = runs(a.seeds, a.backend, ROOT / "outputs" / "studies" / "tiers")
    if a.dry_run:
        from raysplit.config import load_config

        for arm, seed, r in todo:
            cfg = load_config(r.config, r.overrides)
            print(f"{r.label:32s} cut={cfg.model.cut} tiers={cfg.model.tiers and len(cfg.model.tiers)}")
        return
    results = study("tiers-llm", [r for *_, r in todo], a.jobs, metric="eval/perplexity")
    print("| arm | " + " | ".join(KEYS) + " |")
    print("|---" * (len(KEYS) + 1) + "|")
    for arm in ARMS:
        mine = [res for (name, _, _), res in zip(todo, results) if name == arm]
        cells = [median_range([r[k] for r in mine if k in r], ".4g") if any(k in r for r in mine) else "-"
                 for k in KEYS]
        print(f"| {arm} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
