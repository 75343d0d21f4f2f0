"""Privacy building blocks (raysplit/privacy.py): distance correlation against the maintained ``dcor`` package, the
accountant against ``dp_accounting``'s published value, the noise defence off leaving activations untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysplit.privacy import GaussianAccountant, clip_and_noise, distance_correlation, nopeek_loss, quantize


@pytest.mark.parametrize("shape_x, shape_z, dependent", [((50, 3), (50, 2), True), ((40, 1, 8, 8), (40, 16), True),
                                                        ((60, 5), (60, 4), False)])
def test_distance_correlation_equals_dcor(shape_x, shape_z, dependent):
    dcor = pytest.importorskip("dcor")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape_x, generator=g, dtype=torch.float64)
    flat = x.reshape(len(x), -1)
    z = (torch.tanh(flat @ torch.randn(flat.shape[1], int(np.prod(shape_z[1:])), generator=g, dtype=torch.float64))
         if dependent else torch.randn((len(x), int(np.prod(shape_z[1:]))), generator=g, dtype=torch.float64))
    want = dcor.distance_correlation(flat.numpy(), z.numpy())
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
