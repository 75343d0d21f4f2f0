"""Privacy building blocks (raysplit/privacy.py): distance correlation against the maintained ``dcor`` package, the
accountant against ``dp_accounting``'s published value, the noise defence off leaving activations untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysplit.privacy import GaussianAccountant, clip_and_noise, distance_correlation, nopeek_loss, quantize


@pytest.mark.slow  # dcor's import compiles (below): about 40 s of a fresh CI machine's fast tier; the bounds test guards it there
@pytest.mark.parametrize("shape_x, shape_z, dependent", [((50, 3), (50, 2), True), ((40, 1, 8, 8), (40, 16), True),
                                                        ((60, 5), (60, 4), False)])
def test_distance_correlation_equals_dcor(shape_x, shape_z, dependent):
    # dcor compiles its numba kernels when imported (about 30 s on a fresh install, cached after). NUMBA_DISABLE_JIT
    # cannot skip that: with the JIT off dcor's import fails in numba's type inference (seen on a fresh CI install,
    # hidden here by numba's on-disk cache), so the compile is paid once per session.
    dcor = pytest.importorskip("dcor")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape_x, generator=g, dtype=torch.float64)
    flat = x.reshape(len(x), -1)
    z = (torch.tanh(flat @ torch.randn(flat.shape[1], int(np.prod(shape_z[1:])), generator=g, dtype=torch.float64))
         if dependent else torch.randn((len(x), int(np.prod(shape_z[1:]))), generator=g, dtype=torch.float64))
    # dcor's plain numpy path: the same definition, computed without dcor's compiled kernels
    want = dcor.distance_correlation(flat.numpy(), z.numpy(), method="naive", compile_mode=dcor.CompileMode.NO_COMPILE)
    assert float(distance_correlation(x, z.reshape(shape_z))) == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_distance_correlation_bounds_and_nopeek_gradient():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 10, generator=g)
    assert float(distance_correlation(x, 3 * x + 1)) == pytest.approx(1.0, abs=1e-9)  # a similarity: dCor 1
    assert float(distance_correlation(x, torch.zeros(64, 4))) == 0.0  # constant activations reveal nothing
    w = torch.randn(10, 6, generator=g, requires_grad=True)
    loss = nopeek_loss(x, x @ w, alpha=0.5)
    loss.backward()
    assert 0 < float(loss.detach()) <= 0.5 and w.grad is not None and float(w.grad.abs().sum()) > 0  # trains the client


def test_accountant_reproduces_dp_accountings_published_value():
    """dp_accounting's own test (rdp_privacy_accountant_test.py): one Gaussian release with noise multiplier
    4.530877117 is exactly (1, 1e-6)-DP under RDP with orders 1.000, 1.001, ..., 99.999."""
    acc = GaussianAccountant(4.530877117, orders=[0.001 * i for i in range(1000, 100000)])
    acc.record(q=1.0, steps=1)
    assert acc.epsilon(1e-6) == pytest.approx(1.0, abs=1e-4)


def test_accountant_spends_more_with_more_releases_and_less_with_more_noise():
    def eps(sigma, steps, q=0.05):
        a = GaussianAccountant(sigma)
        a.record(q, steps)
        return a.epsilon(1e-5)

    assert eps(1.0, 100) < eps(1.0, 1000) and eps(2.0, 1000) < eps(1.0, 1000)
    split = GaussianAccountant(1.0)
    split.record(0.05, 400)
    split.record(0.05, 600)  # composition: two records of 400 and 600 releases are one of 1000
    assert split.epsilon(1e-5) == pytest.approx(eps(1.0, 1000), rel=1e-9)
    with pytest.raises(ValueError, match="sampling rate"):
        split.record(1.5)
    with pytest.raises(ValueError, match="needs noise"):
        GaussianAccountant(0.0)


def test_noise_off_returns_the_activations_unchanged_and_clipping_bounds_each_sample():
    g = torch.Generator().manual_seed(2)
    z = 5 * torch.randn(32, 4, 3, 3, generator=g)
    assert clip_and_noise(z, None, 0.0) is z
    clipped = clip_and_noise(z, 1.0, 0.0)
    norms = clipped.reshape(32, -1).norm(dim=1)
    assert float(norms.max()) <= 1.0 + 1e-6 and torch.allclose(clipped / norms.reshape(-1, 1, 1, 1),
                                                                z / z.reshape(32, -1).norm(dim=1).reshape(-1, 1, 1, 1))
    noisy = clip_and_noise(torch.zeros(4000, 50), 2.0, 0.5, generator=g)
    assert float(noisy.std()) == pytest.approx(1.0, rel=0.02)  # sigma x clip
    with pytest.raises(ValueError, match="clip must be > 0"):
        clip_and_noise(z, 0.0, 1.0)


def test_quantize_error_and_bytes():
    z = torch.linspace(-1, 3, 1001)
    q, nbytes = quantize(z, 8)
    step = 4 / 255
    assert float((q - z).abs().max()) <= step / 2 + 1e-6 and nbytes == 1001 + 8
    assert len(torch.unique(quantize(z, 2)[0])) == 4
    with pytest.raises(ValueError, match="bits"):
        quantize(z, 0)


# ---- at the cut: the defences in a run, the attack, bad input --------------------------------------------------
from helpers import assert_identical_runs, crashed_run, make_config, run_rounds  # noqa: E402

from raysplit.errors import ConfigError  # noqa: E402
from raysplit.privacy import invert_activations, reconstruction_scores, train_decoder  # noqa: E402


def local(tmp_path, mlflow_uri, **kw):
    return make_config(tmp_path, mlflow_uri, **{"runtime.backend": "local", **kw})


@pytest.mark.parametrize("alg", ["sflv2", "psl", "gas"])
def test_noise_at_sigma_zero_without_clip_equals_the_undefended_run(tmp_path, mlflow_uri, alg):
    """The defence's path (its seeded noise stream, the release, the bytes) changes nothing when it adds nothing."""
    off = run_rounds(local(tmp_path, mlflow_uri, **{"algorithm.name": alg}))
    on = run_rounds(local(tmp_path, mlflow_uri, **{"algorithm.name": alg, "privacy.defence.kind": "noise",
                                                   "privacy.defence.sigma": 0.0}))
    assert on[2].inputs.plan.privacy is not None  # the defence really ran
    assert_identical_runs(off, on)
    for a, b in zip(off[3], on[3], strict=True):
        assert {c: v["bytes_up"] for c, v in a.clients.items()} == {c: v["bytes_up"] for c, v in b.clients.items()}


def test_noise_changes_the_run_and_epsilon_is_the_accountants(tmp_path, mlflow_uri):
    """Each client's reported epsilon is dp_accounting's for its releases: one per step, at rate batch / its
    samples, noise multiplier sigma; the noise reaches the server (the weights differ from the undefended run)."""
    sigma, delta = 1.5, 1e-5
    off = run_rounds(local(tmp_path, mlflow_uri))
    on = run_rounds(local(tmp_path, mlflow_uri, **{"privacy.defence.kind": "noise", "privacy.defence.sigma": sigma,
                                                   "privacy.defence.clip": 5.0, "privacy.defence.delta": delta}))
    assert any(not torch.equal(off[1][k], on[1][k]) for k in off[1])
    sizes = {c: len(v) for c, v in enumerate(on[2].inputs.train_idx)}
    steps = {c: 0 for c in sizes}
    for st in on[3]:
        for c, v in st.clients.items():
            steps[c] += v["steps"]
            acc = GaussianAccountant(sigma)
            acc.record(round(16 / sizes[c], 12), steps[c])
            assert v["dp_epsilon"] == pytest.approx(acc.epsilon(delta), rel=1e-9)
    assert all(s == 8 for s in steps.values())  # 2 rounds x 4 local steps: the count above is not vacuous


def test_epsilon_under_the_event_driver_is_reported_with_each_upload(tmp_path, mlflow_uri):
    """GAS's clients report the budget spent with the model they upload (a job spans rounds): each report lies
    between the accountant's epsilon for the client's steps served before the round and those served by its end."""
    sigma, delta = 1.5, 1e-5
    on = run_rounds(local(tmp_path, mlflow_uri, **{"algorithm.name": "gas", "train.rounds": 4,
                                                   "privacy.defence.kind": "noise", "privacy.defence.sigma": sigma,
                                                   "privacy.defence.clip": 5.0}))
    sizes = {c: len(v) for c, v in enumerate(on[2].inputs.train_idx)}

    def eps(c, steps):
        if not steps:
            return 0.0
        acc = GaussianAccountant(sigma)
        acc.record(round(16 / sizes[c], 12), steps)
        return acc.epsilon(delta)

    steps = dict.fromkeys(sizes, 0)
    reports = 0
    for st in on[3]:
        before = dict(steps)
        for c, v in st.clients.items():
            steps[c] += int(v.get("steps", 0))
        for c, v in st.clients.items():
            if "dp_epsilon" in v:
                reports += 1
                assert eps(c, before[c]) - 1e-9 <= v["dp_epsilon"] <= eps(c, steps[c]) + 1e-9, (c, v["dp_epsilon"])
    assert reports >= 4  # at least one upload a round


def test_quantize_charges_the_quantized_bytes(tmp_path, mlflow_uri):
    off = run_rounds(local(tmp_path, mlflow_uri))
    on = run_rounds(local(tmp_path, mlflow_uri, **{"privacy.defence.kind": "quantize", "privacy.defence.bits": 4}))
    numel = 16 * 16 * 8 * 8  # batch 16 of cnn_small's conv1 activation on 8x8 digits: 16 channels x 8 x 8
    labels = 16 * 8
    for a, b in zip(off[3], on[3], strict=True):
        for c in a.clients:
            n = a.clients[c]["steps"]
            assert a.clients[c]["bytes_up_activations"] == n * (numel * 4 + labels)
            assert b.clients[c]["bytes_up_activations"] == n * (numel // 2 + 8 + labels)


def test_decoder_inverts_an_identity_client_part_and_not_noise():
    from raysplit.data.datasets import load_digits, to_tensor

    data = load_digits()
    aux = to_tensor(data.x_test[:300], data.spec)
    victims = to_tensor(data.x_train[:64], data.spec)
    dec = train_decoder(aux, aux, epochs=10, hidden=256, seed=0)
    assert reconstruction_scores(victims, dec(victims))["ssim"] > 0.95
    g = torch.Generator().manual_seed(0)
    dec = train_decoder(torch.randn(300, 64, generator=g), aux, epochs=10, hidden=256, seed=0)
    scores = reconstruction_scores(victims, dec(torch.randn(64, 64, generator=g)))
    assert scores["ssim"] < 0.3 and scores["psnr"] < 15


def test_inversion_recovers_inputs_through_an_invertible_client_part_and_not_from_noise():
    """He et al.'s white-box inversion: through an identity client part it returns the inputs; through a real
    convolution it recovers them from what that convolution made of them, not from unrelated activations; and it
    differentiates only the inputs (the attacker's copy of the client model is left as it was)."""
    from raysplit.data.datasets import load_digits, to_tensor

    data = load_digits()
    victims = to_tensor(data.x_train[:32], data.spec)
    lo, hi = torch.full((1, 1, 8, 8), float(data.x_test.min())), torch.full((1, 1, 8, 8), float(data.x_test.max()))
    rec = invert_activations(torch.nn.Identity(), victims, lo, hi, steps=200, lr=0.1, tv=0.0)
    assert reconstruction_scores(victims, rec)["ssim"] > 0.95
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU())
    before = {k: v.clone() for k, v in conv.state_dict().items()}
    with torch.no_grad():
        z = conv(victims)
    assert reconstruction_scores(victims, invert_activations(conv, z, lo, hi, 200, 0.1, 0.0))["ssim"] > 0.8
    noise = torch.randn(z.shape, generator=torch.Generator().manual_seed(1)) * z.std()
    assert reconstruction_scores(victims, invert_activations(conv, noise, lo, hi, 200, 0.1, 0.0))["ssim"] < 0.3
    assert all(p.grad is None for p in conv.parameters())
    assert all(torch.equal(v, before[k]) for k, v in conv.state_dict().items())


def test_inversion_end_to_end_through_the_averaged_client_model(tmp_path, mlflow_uri):
    """Under SFLV1 the server holds the averaged client model and inverts through it what the victims send: it
    rebuilds their inputs far better than the same attack given the noise defence's releases."""
    from raysplit.experiment import run_experiment

    common = {"algorithm.name": "sflv1", "privacy.attack.kind": "inversion", "privacy.attack.samples": 32,
              "train.rounds": 2, "tracking.experiment": "privacy-inversion"}
    plain = run_experiment(local(tmp_path / "a", mlflow_uri, **common))
    noised = run_experiment(local(tmp_path / "b", mlflow_uri, **common, **{
        "privacy.defence.kind": "noise", "privacy.defence.sigma": 1.0, "privacy.defence.clip": 5.0}))
    assert plain["privacy/ssim"] > 0.6, plain["privacy/ssim"]
    assert noised["privacy/ssim"] < plain["privacy/ssim"] - 0.3, (noised["privacy/ssim"], plain["privacy/ssim"])


def test_attack_and_nopeek_end_to_end_in_mlflow(tmp_path, mlflow_uri):
    """A run with the attack logs privacy/ssim, psnr, mse and dcor at each evaluation and the reconstruction grid;
    NoPeek's term lowers the distance correlation of the victims' inputs and what the server receives."""
    from mlflow.tracking import MlflowClient

    from raysplit.experiment import run_experiment

    common = {"privacy.attack.kind": "reconstruction", "privacy.attack.aux_size": 200, "privacy.attack.epochs": 2,
              "tracking.experiment": "privacy-e2e",
              "train.rounds": 3, "train.local_steps": 6, "model.cut": "conv2"}
    plain = run_experiment(local(tmp_path, mlflow_uri, **common))
    nopeek = run_experiment(local(tmp_path, mlflow_uri, **common, **{"privacy.defence.kind": "nopeek",
                                                                    "privacy.defence.alpha": 10.0}))
    for out in (plain, nopeek):
        assert {"privacy/ssim", "privacy/psnr", "privacy/mse", "privacy/dcor"} <= set(out)
        assert 0 < out["privacy/ssim"] <= 1 and 0 < out["privacy/dcor"] <= 1
    assert nopeek["privacy/dcor"] < plain["privacy/dcor"] - 0.05, (nopeek["privacy/dcor"], plain["privacy/dcor"])
    client = MlflowClient(mlflow_uri)
    hist = client.get_metric_history(plain["run_id"], "privacy/ssim")
    assert [m.step for m in hist] == [0, 1, 2]
    assert "reconstructions.png" in {a.path for a in client.list_artifacts(plain["run_id"])}
    from raysplit.comparison import compare_runs

    png = tmp_path / "frontier.png"
    text = compare_runs("privacy-e2e", uri=mlflow_uri, plot=str(png), against="privacy/dcor")
    header, *rows = text.splitlines()[:3]
    assert "privacy/dcor" in header.split() and "privacy.defence.kind" in header.split()
    assert any(f"{plain['privacy/dcor']:.4g}" in r for r in rows) and png.stat().st_size > 0


@pytest.mark.parametrize("overrides, needle", [
    ({"algorithm.name": "fedavg", "privacy.attack.kind": "reconstruction"}, "privacy.attack.kind"),
    ({"algorithm.name": "fedavg", "privacy.defence.kind": "quantize"}, "privacy.defence.kind"),
    ({"privacy.attack.kind": "reconstruction", "privacy.attack.aux_size": 100000}, "privacy.attack.aux_size"),
    ({"privacy.attack.kind": "reconstruction", "privacy.attack.aux_size": 100, "privacy.attack.victims": 9},
     "privacy.attack.victims"),
    ({"algorithm.name": "psl", "privacy.attack.kind": "inversion"}, "privacy.attack.kind=inversion"),
    ({"algorithm.name": "ampere", "privacy.defence.kind": "nopeek", "privacy.defence.alpha": 1.0},
     "privacy.defence.kind=nopeek"),
    ({"privacy.defence.kind": "nopeek"}, "privacy.defence.alpha"),
    ({"privacy.defence.kind": "noise", "privacy.defence.clip": 0}, "privacy.defence.clip"),
    ({"privacy.defence.kind": "quantize", "privacy.defence.bits": 32}, "privacy.defence.bits"),
])
def test_bad_privacy_input_names_the_key_before_any_actor(tmp_path, mlflow_uri, overrides, needle):
    from raysplit.experiment import prepare

    with pytest.raises((ConfigError, ValueError), match=needle.replace(".", r"\.")):
        prepare(local(tmp_path, mlflow_uri, **overrides))


def test_resumed_defended_run_spends_and_learns_as_the_uninterrupted_one(tmp_path, mlflow_uri):
    """Each client's release count checkpoints with it: a run resumed after a crash reports the epsilon (and the
    accuracy, the noise streams being seeded per step) of the run that never stopped."""
    from raysplit.experiment import run_experiment

    over = {"train.rounds": 4, "tracking.checkpoint_every": 2, "tracking.experiment": "privacy-resume",
            "privacy.defence.kind": "noise", "privacy.defence.sigma": 0.8, "privacy.defence.clip": 5.0}
    full = run_experiment(local(tmp_path / "a", mlflow_uri, **over))
    cfg = local(tmp_path / "b", mlflow_uri, **over)
    crashed = crashed_run(cfg, mlflow_uri)
    resumed = run_experiment(cfg, resume_run_id=crashed.info.run_id)
    assert resumed["privacy/epsilon"] > 0
    for k in ("privacy/epsilon", "eval/accuracy", "eval/loss", "comm/bytes_up"):
        assert resumed[k] == pytest.approx(full[k], rel=1e-9), k


@pytest.mark.parametrize("alg, attack", [("sflv2", "reconstruction"), ("gas", "reconstruction"),
                                         ("gas", "inversion")])
def test_the_attack_observes_and_changes_nothing(tmp_path, mlflow_uri, alg, attack):
    """A run with an attack gives every metric of the same run without it (the attack's own privacy/ metrics
    aside): fitting the decoder or inverting draws no randomness the training uses and changes no model."""
    from raysplit.experiment import run_experiment
    from raysplit.metrics import WALL_CLOCK

    base = {"algorithm.name": alg, "train.rounds": 3, "tracking.experiment": "privacy-observer"}
    plain = run_experiment(local(tmp_path / "a", mlflow_uri, **base))
    own = {"reconstruction": {"aux_size": 100, "epochs": 1}, "inversion": {"steps": 20}}[attack]
    watched = run_experiment(local(tmp_path / "b", mlflow_uri, **base, **{"privacy.attack": {"kind": attack, **own}}))
    assert "privacy/ssim" in watched
    same = {k: v for k, v in watched.items() if not k.startswith("privacy/") and k not in WALL_CLOCK | {"run_id"}}
    assert same == {k: v for k, v in plain.items() if k not in WALL_CLOCK | {"run_id"}}


def test_a_key_another_defence_or_attack_takes_is_refused_by_name():
    """``privacy.defence`` and ``privacy.attack`` are typed sections picked by ``kind`` (each plug-in owns its keys):
    a key the picked one does not take is one error naming it and saying how to switch; a section without ``kind``
    is the default's (none), so a lone key is refused rather than ignored."""
    from raysplit.config import load_config

    with pytest.raises(ConfigError, match=r"unknown key 'privacy.defence.sigma' \(defence nopeek\); allowed here: "
                                          r"alpha, kind .*privacy.defence=\{kind: nopeek\}"):
        load_config(None, ["privacy.defence.kind=nopeek", "privacy.defence.alpha=1", "privacy.defence.sigma=0.5"])
    with pytest.raises(ConfigError, match=r"unknown key 'privacy.defence.sigma' \(defence none\)"):
        load_config(None, ["privacy.defence.sigma=0.5"])
    with pytest.raises(ConfigError, match=r"unknown key 'privacy.attack.epochs' \(attack inversion\)"):
        load_config(None, ["privacy.attack.kind=inversion", "privacy.attack.epochs=3"])
    with pytest.raises(ConfigError, match=r"privacy.defence.alpha"):
        load_config(None, ["privacy.defence.kind=nopeek"])  # NoPeek's weight has no default: 0 is no defence
    cfg = load_config(None, ["privacy.defence.kind=noise", "privacy.defence.sigma=0.5", "privacy.attack.kind=inversion"])
    assert (cfg.privacy.defence.sigma, cfg.privacy.defence.delta, cfg.privacy.attack.steps) == (0.5, 1e-5, 200)
