"""Golden fingerprints: one tiny deterministic run per algorithm that ``raysplit list`` shows, its per-round metrics
stored in tests/golden/ALGORITHM.json, so that a change of any method's behaviour fails a test naming it.

    python scripts/golden.py                  # rerun every algorithm, rewrite tests/golden/ (make golden)
    python scripts/golden.py gas hydra        # only these
    python scripts/golden.py --check          # rerun and compare, exit 1 naming algorithm, metric, round
    python scripts/golden.py --fingerprints   # print each stored file's fingerprint (no training)

Each run: scikit-learn's digits (bundled, no download), 6 clients, iid, 20 % client test splits, ``cnn_small``
cut after conv1, 3 rounds of 3 clients x 3 batches of 16 (SGD, momentum 0.9), heterogeneous client speeds
(``clock.profile: uniform``), evaluation every round, local backend, no MLflow. The full test tier reruns every
fingerprint through Ray actors too (tests/test_golden.py), so the Ray backend is held to the same numbers. Every algorithm parameter keeps its default; only what sets a run's
length is bounded where the default would run for minutes (Ampere's phase caps, the semi-supervised methods' K_s
steps and labelled batch) and what a family needs to run at all is given (images for the augmentations, a labelled
set). Stored per round: every metric the run logs but the wall-clock ones (``WALL_CLOCK``).

A commit that changes a fingerprint says why in its message and reruns that method's result pages
(docs/results/) in the same change. The fingerprint of a method (``fingerprint()``, a digest of its stored file)
is what the results pages' stamps name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"

# a fingerprint holds every metric a round logs (accuracy, losses, bytes, FLOPs, simulated time, per-label and
# method-specific numbers) but those that measure the machine rather than the method
sys.path.insert(0, str(ROOT))
from raysplit.metrics import WALL_CLOCK  # noqa: E402

# floats are compared with this relative tolerance: far below what any change of a method moves (the first digit
# of a loss after a changed step; flipping GAS's `generate` moves accuracy by 3 %), above what another CPU's vector
# units give. Measured: fingerprints made on an AVX2 machine, rerun on an AVX-512 one (AMD EPYC), differ in the
# gradient norms of two methods by up to 1.2e-4 of the mean (cyclesglr, sflv1_scaffold; every other metric within
# 1e-5). A spread (`*_std`) is compared on the scale of its mean: a std of 4.0e-4 over norms of 2.5e-2 that moves
# by 2.3e-6 is that same last-bits drift, not a change of method.
REL_TOL, ABS_TOL = 1e-3, 1e-9
# an attack's reconstruction scores are the end of an optimisation over the reconstructed inputs (the inversion's 30
# Adam steps in the golden run), which carries the vector units' last bits through every step: the relative tolerance
# for them is 1e-2. Measured: privacy_inversion's fingerprint, made on an AVX2 machine, gives privacy/mse 0.0051730
# at round 2; on an AVX-512 AMD EPYC it gives 0.0051629 (-0.20 %), and 0.0051408-0.0051674 (up to -0.62 %) with
# oneDNN or ATen held to other instruction sets there (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY); its training
# metrics stay within 1e-3 on all of them. A changed attack (its prior, steps or step size) moves them by more.
RECONSTRUCTION = ("privacy/mse", "privacy/psnr", "privacy/ssim")
RECONSTRUCTION_REL_TOL = 1e-2

BASE: dict = {
    "name": "golden", "seed": 0,
    "data.dataset": "digits", "data.num_clients": 6, "data.partition.name": "iid", "data.test_fraction": 0.2,
    "model.name": "cnn_small", "model.cut": "conv1",
    "train.rounds": 3, "train.batch_size": 16, "train.local_steps": 3, "train.participation.count": 3,
    "train.optimizer.lr": 0.05, "train.optimizer.momentum": 0.9,
    "clock.profile": "uniform", "eval.every": 1,
    "runtime.backend": "local", "tracking.enabled": False, "tracking.progress": False,
}
FAKE_FMNIST = "<tests/helpers.py write_fake_fashion_mnist(600 train, 100 test images)>"
# per algorithm, only what its run needs beyond BASE
NEEDS: dict[str, dict] = {
    "ampere": {"algorithm.device_rounds": 2, "algorithm.server_epochs": 2, "algorithm.chunk_rows": 64,
               "train.rounds": 4},
    # SplitLoRA fine-tunes a language model's LoRA adapters: a tiny GPT-2 on four of Debian's fortune categories
    # (one client each), U-shaped, its BPE trained on the training split
    "splitlora": {"data.num_clients": 4, "data.partition.name": "natural", "data.test_fraction": 0.0,
                  "data.text.corpus": "fortunes", "data.text.categories": ["goedel", "magic", "paradoxum", "riddles"],
                  "data.text.context_length": 32, "data.text.test_fraction": 0.2,
                  "data.text.tokenizer.vocab_size": 300, "model.cut": "block1", "model.lm.family": "gpt2",
                  "model.lm.layers": 2, "model.lm.width": 32, "model.lm.heads": 2, "model.lm.max_positions": 32,
                  "model.lm.adapter.rank": 4, "model.lm.adapter.target_modules": ["c_attn", "c_fc", "lm_head"],
                  "algorithm.aggregation_interval": 2},
    # augmentation needs images: a small fake Fashion-MNIST in the real IDX format, written for the run
    **{name: {"data.dataset": "fashion_mnist", "data.root": FAKE_FMNIST, "data.options": {"search_system": False},
              "data.n_labeled": 100, "algorithm.ks_initial": 4, "algorithm.server_batch_size": 16}
       for name in ("semisfl", "fedswitch_sl", "supervised_only", "semifl")},
}


# the privacy plug-ins (``privacy:`` section), each fingerprinted on a method of another family, so that a change of
# a defence or of the attack fails a test naming it as a change of a method does (docs/results/privacy.md's stamps)
PLUGINS: dict[str, dict] = {
    "privacy_noise": {"algorithm.name": "sflv2", "privacy.defence.kind": "noise", "privacy.defence.sigma": 0.5,
                      "privacy.defence.clip": 5.0, "privacy.attack.kind": "reconstruction",
                      "privacy.attack.aux_size": 100, "privacy.attack.samples": 32, "privacy.attack.epochs": 2},
    "privacy_nopeek": {"algorithm.name": "psl", "privacy.defence.kind": "nopeek", "privacy.defence.alpha": 1.0},
    "privacy_quantize": {"algorithm.name": "gas", "privacy.defence.kind": "quantize", "privacy.defence.bits": 4},
    "privacy_inversion": {"algorithm.name": "gas", "privacy.attack.kind": "inversion", "privacy.attack.samples": 16,
                          "privacy.attack.steps": 30},
    # the U-shaped split (model.tail_cut) with the label attack and each label defence
    "ushape_label_noise": {"algorithm.name": "sflv2", "model.tail_cut": "fc1",
                           "privacy.label_attack": {"kind": "gradient_scoring"},
                           "privacy.label_defence": {"kind": "noise", "scale": 1.0}},
    "ushape_max_norm": {"algorithm.name": "psl", "model.tail_cut": "conv2",
                        "privacy.label_attack": {"kind": "gradient_scoring"},
                        "privacy.label_defence": {"kind": "max_norm"}},
}


def algorithms() -> list[str]:
    """The algorithms ``raysplit list`` shows, then the privacy plug-ins' runs (``PLUGINS``)."""
    from raysplit.algorithms import ALGORITHMS

    return sorted(ALGORITHMS) + sorted(PLUGINS)


def overrides(name: str) -> dict:
    if name in PLUGINS:
        return {**BASE, **PLUGINS[name]}
    return {**BASE, "algorithm.name": name, **NEEDS.get(name, {})}


def run(name: str, on_round=None, on_checkpoint=None, **extra) -> dict:
    """Run ``name``'s golden configuration (``extra``: dotted overrides on top, e.g. ``runtime.backend="ray"``;
    ``on_round(rnd, metrics)`` and ``on_checkpoint(rnd, path, run_id)``: called as ``run_experiment``'s, the latter
    while the checkpoint file still exists); returns the fingerprint record (what tests/golden/NAME.json holds)."""
    from raysplit.config import load_config
    from raysplit.experiment import run_experiment

    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        over = overrides(name)
        if over.get("data.root") == FAKE_FMNIST:
            sys.path.insert(0, str(ROOT / "tests"))
            from helpers import write_fake_fashion_mnist

            write_fake_fashion_mnist(Path(tmp) / "data")
            over["data.root"] = str(Path(tmp) / "data")
        cfg = load_config(None, {**over, "tracking.output_dir": str(Path(tmp) / "out"), **extra})

        def record(rnd: int, m: dict) -> None:
            rounds.append({"round": rnd, **{k: float(v) for k, v in sorted(m.items()) if k not in WALL_CLOCK}})
            if on_round is not None:
                on_round(rnd, m)

        run_experiment(cfg, on_round=record, on_checkpoint=on_checkpoint)
    return {"algorithm": name, "overrides": overrides(name), "rounds": rounds}


def path(name: str) -> Path:
    return GOLDEN / f"{name}.json"


def load(name: str) -> dict:
    return json.loads(path(name).read_text())


def dumps(record: dict) -> str:
    """A record as tests/golden/ stores it (the results pages' stamps digest these bytes)."""
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def write(record: dict) -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    path(record["algorithm"]).write_text(dumps(record))


def fingerprint(name: str) -> str:
    """The stored fingerprint's digest: 12 hex digits of SHA-256 over its file (the per-round metrics and the
    configuration that made them), the one digest the results pages' stamps name (scripts/stamps.py)."""
    return digest(path(name))


def digest(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()[:12]


def differences(expected: dict, got: dict) -> list[str]:
    """One line per metric and round that differs, naming algorithm, metric, round, expected and got."""
    name = expected["algorithm"]
    out = []
    if len(expected["rounds"]) != len(got["rounds"]):
        out.append(f"{name}: {len(got['rounds'])} rounds, expected {len(expected['rounds'])}")
    for want, have in zip(expected["rounds"], got["rounds"]):
        for k in sorted(set(want) | set(have)):
            a, b = want.get(k), have.get(k)
            scale = abs(want.get(k[:-4] + "_mean") or 0.0) if k.endswith("_std") else 0.0
            rel = RECONSTRUCTION_REL_TOL if k in RECONSTRUCTION else REL_TOL
            same = (a is not None and b is not None and
                    (math.isclose(a, b, rel_tol=rel, abs_tol=max(ABS_TOL, rel * scale))
                     or (math.isnan(a) and math.isnan(b))))
            if not same:
                out.append(f"{name}: {k} at round {want['round']}: expected {a!r}, got {b!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="algorithms (default: all that `raysplit list` shows)")
    ap.add_argument("--check", action="store_true", help="compare with tests/golden/ instead of rewriting it")
    ap.add_argument("--fingerprints", action="store_true", help="print the stored fingerprints and stop")
    args = ap.parse_args(argv)
    names = args.names or algorithms()
    unknown = sorted(set(names) - set(algorithms()))
    if unknown:
        print(f"unknown algorithm(s) {', '.join(unknown)}; registered: {', '.join(algorithms())}", file=sys.stderr)
        return 2
    if args.fingerprints:
        for name in names:
            print(f"{name:16s} {fingerprint(name) if path(name).is_file() else '(none)'}")
        return 0
    failed = []
    for name in names:
        t0 = time.perf_counter()
        got = run(name)
        if args.check:
            diff = differences(load(name), got) if path(name).is_file() else [f"{name}: no {path(name)}"]
            failed += diff
            print(f"{name:16s} {'differs' if diff else 'ok'} ({time.perf_counter() - t0:.1f} s)", flush=True)
        else:
            old = load(name) if path(name).is_file() else None
            write(got)
            what = "new" if old is None else ("changed" if differences(old, got) else "unchanged")
            print(f"{name:16s} {fingerprint(name)} {what} ({time.perf_counter() - t0:.1f} s)", flush=True)
    for line in failed:
        print(f"  {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
