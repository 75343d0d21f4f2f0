"""The paper-scale configs (configs/<paper>/, issue 53 item 5): each reads its dataset from files in the real
format (small fakes written here, as a user's downloads would be laid out under data.root), builds its model,
splits it at its cut and runs one round in process. What is reduced so that a round takes seconds on a CPU is
listed per config in ``LIGHTER`` (local steps, the server's supervised steps, the labelled set's size); the
model, cut, dataset, partition, clients and participation are the config's own."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_fake_cifar10, write_fake_cifar100, write_fake_leaf, write_fake_svhn

from raysplit.config import load_config
from raysplit.experiment import prepare, run_experiment

ROOT = Path(__file__).resolve().parent.parent

# each paper-scale config (not FMNIST: those run on the real Fashion-MNIST elsewhere) and what a one-round test
# lightens
LIGHTER = {
    "ampere/cifar10_mobilenet.yaml": {},
    "ampere/cifar10_vit.yaml": {},
    "cyclesl/cifar100_resnet9.yaml": {},
    "cyclesl/femnist.yaml": {},
    "cyclesl/shakespeare.yaml": {},
    "gas/cifar10.yaml": {"train.local_steps": 2},
    "hydra/cifar10_mobilenet.yaml": {},
    "semisfl/cifar10.yaml": {"train.local_steps": 2, "algorithm.ks_initial": 2, "data.n_labeled": 200},
    "semisfl/svhn.yaml": {"train.local_steps": 2, "algorithm.ks_initial": 2, "data.n_labeled": 200},
}
WRITE = {"cifar10": lambda r: write_fake_cifar10(r, per_batch=200, test=50),
         "cifar100": lambda r: write_fake_cifar100(r / "cifar100", train=1000, test=100),
         "svhn": lambda r: write_fake_svhn(r, train=1000, test=50),
         "femnist": lambda r: write_fake_leaf(r, "femnist", users=40, per_user=8),
         "shakespeare": lambda r: write_fake_leaf(r, "shakespeare", users=40, per_user=8)}


# what a config's one round must show beyond accuracy and bytes (these were the checks of test_gas's and
# test_semisfl's own one-round runs of the same configs, folded in here so that CI runs each config once)
CHECKS = {
    "gas/cifar10.yaml": lambda p, out: (p.cut_name == "conv2" and p.inputs.plan.sections.train.clip_grad_norm == 10.0
                                        and out["method/server_updates"] >= 1 and out["time/sim"] > 0),
    "semisfl/cifar10.yaml": lambda p, out: out["method/ks"] == 2,
    "semisfl/svhn.yaml": lambda p, out: out["method/ks"] == 2,
}


def test_every_paper_scale_config_is_listed():
    have = {str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").glob("*/*.yaml")}
    # configs/llm/: each runs a round in tests/test_lm_configs.py (on the installed fortunes or fake files);
    # configs/tiers/llm.yaml runs on the installed fortunes in tests/test_tiers_lm.py
    paper = {p for p in have if not p.startswith(("privacy/", "llm/")) and "fmnist" not in p
             and p != "tiers/llm.yaml"}
    assert paper == set(LIGHTER), sorted(paper ^ set(LIGHTER))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LIGHTER))
def test_a_paper_scale_config_runs_one_round_on_files_in_the_real_format(name, tmp_path):
    cfg = load_config(ROOT / "configs" / name)
    data = tmp_path / "data"
    WRITE[cfg.data.dataset](data)
    cfg = load_config(ROOT / "configs" / name, {
        "data.root": str(data), "train.rounds": 1, "eval.every": 1, "runtime.backend": "local",
        "tracking.enabled": False, "tracking.progress": False, "tracking.output_dir": str(tmp_path / "out"),
        **LIGHTER[name]})
    out = run_experiment(cfg)
    assert 0.0 <= out["eval/accuracy"] <= 1.0 and out["comm/bytes_up"] > 0, out
    if name in CHECKS:
        assert CHECKS[name](prepare(cfg), out), out
