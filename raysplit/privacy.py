"""Privacy building blocks at the cut (building block: no Ray, no MLflow): what a defence does to the activations a
client sends, and what it spends.

- ``distance_correlation``: the sample distance correlation of Székely, Rizzo and Bakirov (2007) between a batch of
  inputs and the activations made from them, differentiable (torch); equal to ``dcor.distance_correlation`` (its
  biased V-statistic), tested against it. NoPeek (Vepakomma et al., "NoPeek: Information leakage reduction to share
  activations in distributed deep learning", 2020) adds ``alpha * dCor(x, z)`` to the client's loss:
  ``nopeek_loss``.
- ``clip_and_noise``: the Gaussian mechanism on each sample's activation: clipped to L2 norm ``clip``, then
  N(0, (sigma * clip)^2) noise per coordinate; sigma 0 with no clip returns the input unchanged.
- ``GaussianAccountant``: the privacy one client spends by releasing noised activations, counted with Google's
  maintained ``dp_accounting`` (Rényi DP accountant), never by hand: each step releases a batch drawn from the
  client's data (sampling rate q), every release a Poisson-subsampled Gaussian mechanism of noise multiplier sigma.
  The sampling is treated as Poisson, as DP-SGD analyses treat their batches (Abadi et al. 2016); raysplit draws
  batches without replacement, a common approximation that the page reporting epsilon states.
- ``quantize``: uniform quantization of a tensor to ``bits`` bits (min-max per tensor), its cost in bytes.

The hooks that put these at the cut (client side) and the attacks that watch the server's inputs are issue 31's
next step; off, none of them is called.
"""

from __future__ import annotations

import torch


def _centered_distances(a: torch.Tensor) -> torch.Tensor:
    """The doubly centered matrix of Euclidean distances between the rows of ``a`` (samples x features)."""
    d = torch.cdist(a, a, compute_mode="donot_use_mm_for_euclid_dist")  # exact, not |a|^2 + |b|^2 - 2ab
    return d - d.mean(0, keepdim=True) - d.mean(1, keepdim=True) + d.mean()


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Sample distance correlation between ``x`` and ``z`` (first axis: the same samples; the rest flattened), in
    [0, 1]; 0 when either is constant. Differentiable in both."""
    if len(x) != len(z):
        raise ValueError(f"distance correlation needs the same samples: {len(x)} inputs, {len(z)} activations")
    a = _centered_distances(x.reshape(len(x), -1).double())
    b = _centered_distances(z.reshape(len(z), -1).double())
    dcov2_xy = (a * b).mean()
    dcov2_xx, dcov2_yy = (a * a).mean(), (b * b).mean()
    denom = (dcov2_xx * dcov2_yy).sqrt()
    if denom <= 0:
        return torch.zeros((), dtype=torch.float64)
    return (dcov2_xy.clamp_min(0) / denom).sqrt()


def nopeek_loss(x: torch.Tensor, z: torch.Tensor, alpha: float) -> torch.Tensor:
    """NoPeek's leakage term for a client's loss: ``alpha`` times the distance correlation of inputs and
    activations (``z`` keeps its graph, so the term trains the client part)."""
    return alpha * distance_correlation(x.detach(), z).to(z.dtype)


def clip_and_noise(z: torch.Tensor, clip: float | None, sigma: float,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Each sample's activation (first axis) scaled to L2 norm at most ``clip``, then Gaussian noise of standard
    deviation ``sigma * clip`` (``sigma`` alone when ``clip`` is None: noise without a sensitivity bound, which no
    accountant can turn into an epsilon). ``clip=None, sigma=0`` returns ``z`` itself."""
    if sigma < 0 or (clip is not None and clip <= 0):
        raise ValueError(f"clip_and_noise: clip must be > 0 (or None) and sigma >= 0, got clip={clip}, sigma={sigma}")
    out = z
    if clip is not None:
        norms = z.reshape(len(z), -1).norm(dim=1).clamp_min(1e-12)
        scale = (clip / norms).clamp(max=1.0).reshape(-1, *([1] * (z.dim() - 1)))
        out = z * scale
    if sigma > 0:
        std = sigma * (clip if clip is not None else 1.0)
        out = out + std * torch.randn(z.shape, generator=generator, dtype=z.dtype, device=z.device)
    return out


class GaussianAccountant:
    """Epsilon spent by one client's noised releases (``dp_accounting``'s RDP accountant). ``record(q, steps)``:
    ``steps`` releases of batches drawn at rate ``q`` = batch / the client's samples, each a Gaussian mechanism of
    noise multiplier ``sigma`` (``clip_and_noise``'s sigma; the sensitivity is the clip)."""

    def __init__(self, sigma: float, orders: list[float] | None = None):
        from dp_accounting import dp_event
        from dp_accounting.rdp import RdpAccountant

        if sigma <= 0:
            raise ValueError(f"an accountant needs noise: sigma={sigma}")
        self.sigma = sigma
        self._event = dp_event
        self._acc = RdpAccountant(orders) if orders is not None else RdpAccountant()

    def record(self, q: float, steps: int = 1) -> None:
        if not 0 < q <= 1:
            raise ValueError(f"sampling rate q must be in (0, 1], got {q}")
        ev = self._event.GaussianDpEvent(self.sigma)
        self._acc.compose(ev if q == 1 else self._event.PoissonSampledDpEvent(q, ev), int(steps))

    def epsilon(self, delta: float) -> float:
        return float(self._acc.get_epsilon(delta))


def quantize(z: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """``z`` rounded to ``2**bits`` evenly spaced levels between its min and max (what the server receives,
    dequantized) and the bytes that carries: ``bits`` per value plus the two float32 bounds."""
    if not 1 <= bits <= 16:
        raise ValueError(f"quantize: bits must be in 1..16, got {bits}")
    lo, hi = z.min(), z.max()
    levels = 2 ** bits - 1
    step = (hi - lo) / levels if hi > lo else torch.ones((), dtype=z.dtype)
    q = torch.round((z - lo) / step).clamp(0, levels)
    return lo + q * step, (z.numel() * bits + 7) // 8 + 8
