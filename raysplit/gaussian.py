"""Per-label Gaussian statistics of activations, merged buffer by buffer, with a sampler (GAS's generative
activations; building block: no Ray, no MLflow).

GAS (seed-code.md §1.3-1.4) keeps, per label, a weighted mean and covariance of the activations it has received.
A buffer's activations a_i with weights w_i give ``W_new = sum w_i``, ``mu_new`` and ``S_new`` (weighted mean and
covariance); they merge into the stored ``(W_old, mu_old, S_old)`` with ``d = W_old / W``:

    mu = d mu_old + (1-d) mu_new
    S  = d (S_old + (mu-mu_old)(mu-mu_old)^T) + (1-d) (S_new + (mu-mu_new)(mu-mu_new)^T) + eps I

(the first buffer of a label sets the statistics directly, with no ``eps I``). Without the ``eps I`` terms this is
exactly the weighted covariance of everything seen so far.

The authors' code rebuilds ``MultivariateNormal(mu, S)`` — a Cholesky factorisation of a D x D matrix, with
jitter retries — for every label at every server update. Here nothing is re-factorised: ``S`` is kept as
``S~ + c I`` where ``c`` accumulates the ``eps`` terms (``c <- d c + eps``) and ``S~`` is PSD by construction,
because every merge adds ``d S~_old + U U^T`` with the r = n+2 columns of ``U`` being
``sqrt((1-d) w_i / W_new) (a_i - mu_new)``, ``sqrt(d) (mu - mu_old)`` and ``sqrt(1-d) (mu - mu_new)``. Kinds:

- ``full``: S~ + delta I = scale * R^T R + (the merges not yet folded into R, kept as their columns). R is an
  upper-triangular float32 matrix updated by LAPACK's triangular-pentagonal QR (``stpqrt``) of
  ``[sqrt(scale) R; U^T]`` once ``fold_columns`` columns have queued: O(D^2 r) per merge instead of O(D^3),
  never a factorisation from scratch. ``delta`` starts at ``delta0`` (1e-6: the code's first jitter retry, which
  is what its factorisation of the singular first-buffer covariance falls back to) and shrinks with every ``d``.
  A sample is a sum of independent Gaussian parts, ``mu + sqrt(scale) R^T g + sum_b U_b g_b + sqrt(c - delta)
  e``, i.e. exactly N(mu, S) from the second merge on (N(mu, S~ + delta0 I) after the first, as the code's retry).
- ``diagonal``: only the variances (the code's commented-out variant for large activations).
- ``lowrank``: ``S~`` kept as ``F F^T`` with at most ``rank`` columns (a truncated SVD whenever the columns pass
  ``2 rank``); samples ``mu + F g + sqrt(c) e``. The truncated variance is dropped.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from scipy.linalg import lapack

Kind = Literal["full", "diagonal", "lowrank"]


class LabelGaussian:
    """Running statistics of one label's (flattened) activations and a sampler from N(mu, S)."""

    def __init__(self, dim: int, kind: Kind = "full", rank: int = 32, eps: float = 1e-5, delta0: float = 1e-6,
                 fold_columns: int = 256):
        if kind not in ("full", "diagonal", "lowrank"):
            raise ValueError(f"unknown covariance kind {kind!r} (full | diagonal | lowrank)")
        self.dim, self.kind, self.rank, self.eps, self.delta0 = dim, kind, rank, eps, delta0
        self.fold_columns = fold_columns
        self.weight = 0.0  # W
        self.mean = np.zeros(dim)
        self.jitter = 0.0  # c: S = S~ + c I
        self.merges = 0
        self.var = np.zeros(dim) if kind == "diagonal" else None  # diagonal: diag(S~)
        self.factor = None  # full: R (float32, upper triangular; None = identity); lowrank: F (dim x k)
        # full: S~ + delta I = scale * R^T R + sum_b s_b U_b U_b^T over the queued blocks (scale, U_b)
        self.scale = 1.0
        self.delta = 0.0
        self._queued: list[list] = []

    # ---- merging ---------------------------------------------------------------------------------------------
    def merge(self, a: np.ndarray, w: np.ndarray) -> None:
        """Merge a buffer's activations ``a`` (n x dim) with per-sample weights ``w`` (n,)."""
        a = np.asarray(a, dtype=np.float64).reshape(len(a), -1)
        w = np.asarray(w, dtype=np.float64)
        w_new = float(w.sum())
        mu_new = (w[:, None] * a).sum(axis=0) / w_new
        centred = (a - mu_new) * np.sqrt(w / w_new)[:, None]  # S_new = centred^T centred
        first = self.merges == 0
        if first:
            d, mu, cols = 0.0, mu_new, centred.T
        else:
            d = self.weight / (self.weight + w_new)
            mu = d * self.mean + (1 - d) * mu_new
            cols = np.concatenate([centred.T * np.sqrt(1 - d), (np.sqrt(d) * (mu - self.mean))[:, None],
                                   (np.sqrt(1 - d) * (mu - mu_new))[:, None]], axis=1)
        if self.kind == "diagonal":
            self.var = d * self.var + (cols ** 2).sum(axis=1)
        elif self.kind == "full":
            if first:
                self.delta, self.scale = self.delta0, self.delta0  # R = I stands for sqrt(delta0) I
            else:
                self.scale *= d
                self.delta *= d
                for block in self._queued:
                    block[0] *= d
            self._queued.append([1.0, np.asfortranarray(cols, dtype=np.float32)])
            if sum(b[1].shape[1] for b in self._queued) >= self.fold_columns:
                self._fold()
        else:
            f = cols if first else np.concatenate([np.sqrt(d) * self.factor, cols], axis=1)
            if f.shape[1] > 2 * self.rank:
                u, s, _ = np.linalg.svd(f, full_matrices=False)
                f = u[:, :self.rank] * s[:self.rank]
            self.factor = f
        self.jitter = 0.0 if first else d * self.jitter + self.eps
        self.weight += w_new
        self.mean = mu
        self.merges += 1

    def _fold(self) -> None:
        """Full kind: R <- the R of qr([sqrt(scale) R; sqrt(s_b) U_b^T ...]) for the queued blocks (LAPACK ?tpqrt,
        float32; the zero lower triangle of R is not referenced, so it stays zero)."""
        if not self._queued:
            return
        b = np.asfortranarray(np.concatenate([np.sqrt(s) * u for s, u in self._queued], axis=1).T,
                              dtype=np.float32)
        self._queued = []
        if self.factor is None:
            self.factor = np.asfortranarray(np.eye(self.dim, dtype=np.float32))
        if self.scale != 1.0:
            self.factor *= np.float32(np.sqrt(self.scale))
        r, _, _, info = lapack.stpqrt(0, max(1, min(64, self.dim, b.shape[0])), self.factor, b, overwrite_a=True,
                                      overwrite_b=True)
        if info != 0:
            raise FloatingPointError(f"LAPACK stpqrt failed (info={info})")
        self.factor, self.scale = r, 1.0

    # ---- reading ---------------------------------------------------------------------------------------------
    def scatter(self) -> np.ndarray:
        """S~: the merged weighted covariance without the jitter terms (dim x dim; for tests and diagnostics)."""
        if self.kind == "diagonal":
            return np.diag(self.var)
        if self.kind == "full":
            self._fold()
            r = np.eye(self.dim) if self.factor is None else self.factor.astype(np.float64)
            return self.scale * (r.T @ r) - self.delta * np.eye(self.dim)
        return self.factor @ self.factor.T

    def covariance(self) -> np.ndarray:
        """The covariance the sampler draws from: S~ + c I (full, after the first merge: S~ + delta0 I)."""
        extra = max(self.jitter, self.delta) if self.kind == "full" else self.jitter
        return self.scatter() + extra * np.eye(self.dim)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` draws (n x dim, float64): a sum of independent Gaussian parts, one per factor."""
        if self.kind == "diagonal":
            return self.mean + rng.standard_normal((n, self.dim)) * np.sqrt(self.var + self.jitter)
        if self.kind == "lowrank":
            out = self.mean + rng.standard_normal((n, self.factor.shape[1])) @ self.factor.T
            extra = self.jitter
        else:
            g = rng.standard_normal((n, self.dim)).astype(np.float32)
            part = g if self.factor is None else g @ self.factor
            out = self.mean + np.sqrt(self.scale) * part.astype(np.float64)
            for s, u in self._queued:
                out += np.sqrt(s) * (rng.standard_normal((n, u.shape[1])).astype(np.float32) @ u.T)
            extra = self.jitter - self.delta
        if extra > 0:
            out = out + np.sqrt(extra) * rng.standard_normal((n, self.dim))
        return out

    def finite(self) -> bool:
        parts = [self.mean] + [p for p in (self.var, self.factor) if p is not None] + [u for _, u in self._queued]
        return all(np.isfinite(p).all() for p in parts)
