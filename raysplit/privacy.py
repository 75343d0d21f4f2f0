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

At the cut: ``PrivacySpec`` (what the ``privacy`` config section resolves to, shipped to the hosts) and ``CutDefence``
(what a client host applies to each activation before it leaves, and the loss term it adds); the reconstruction
attacks, each a plug-in (``Attack``: ``ATTACK_PLUGINS``, listed by ``raysplit list``) given an ``AttackView`` of
one victim: ``InverseNetwork`` (``train_decoder``) and ``WhiteBoxInversion`` (``invert_activations``), scored by
``reconstruction_scores`` (SSIM and PSNR from torchmetrics); on a language model ``NearestEmbedding`` and
``TokenInversion`` (raysplit/token_privacy.py), scored by the fraction of tokens recovered. Off
(``privacy.defence.kind: none``), no host calls any of them and a run's results are those of a run without the
section, bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from raysplit.errors import ConfigError


class DefenceParams(BaseModel):
    """A defence's keys under ``privacy.defence``: one model per defence, picked by ``kind`` (a key another defence
    takes is an error naming it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    KIND: ClassVar[str] = "defence"  # what an error calls the member that ``kind`` picked
    active: ClassVar[bool] = True  # it changes what leaves the client (or its loss)
    keeps_inputs: ClassVar[bool] = False  # it needs each forward's inputs beside its activation (a loss term)

    @property
    def sent_bits(self) -> int | None:
        """The bits per value an activation is sent at (None: the float tensor's own)."""
        return None

    def release(self, z: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """What leaves the client instead of the activation ``z`` (its graph kept, so the server's gradient reaches
        the client part) and the bytes it takes (None: the tensor's own); random draws from torch's current
        stream (the caller seeds it)."""
        return z, None


class NoDefence(DefenceParams):
    kind: Literal["none"] = Field(default="none", description="none: no defence, activations leave the client as "
                                  "computed")
    active: ClassVar[bool] = False


class NoiseDefence(DefenceParams):
    kind: Literal["noise"] = Field(description="noise: Gaussian mechanism per sample (clip each activation to L2 "
                                   "norm clip, add N(0, (sigma clip)^2)); epsilon per client with dp_accounting's "
                                   "RDP accountant")
    sigma: float = Field(default=0.0, ge=0, le=100, description="noise multiplier (std = sigma x clip; sigma alone "
                         "without a clip, then no epsilon)")
    clip: float | None = Field(default=None, gt=0, description="each sample's activation clipped to this L2 norm "
                               "first (the sensitivity; needed for an epsilon)")
    delta: float = Field(default=1e-5, gt=0, lt=1, description="the delta epsilon is reported at")

    def release(self, z: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        return clip_and_noise(z, self.clip, self.sigma), None


class NopeekDefence(DefenceParams):
    kind: Literal["nopeek"] = Field(description="nopeek: NoPeek (Vepakomma et al. 2020), alpha x distance "
                                    "correlation of inputs and activations added to the client's loss")
    alpha: float = Field(gt=0, le=100, description="weight of the distance correlation term (required: 0 is no "
                         "defence, kind none)")
    keeps_inputs: ClassVar[bool] = True


class QuantizeDefence(DefenceParams):
    kind: Literal["quantize"] = Field(description="quantize: uniform quantization of each activation batch to "
                                      "bits bits (min-max), charged at its size")
    bits: int = Field(default=8, ge=1, le=16, description="bits per value")

    @property
    def sent_bits(self) -> int | None:
        return self.bits

    def release(self, z: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        q, nbytes = quantize(z.detach(), self.bits)
        return z + (q - z.detach()), nbytes  # a straight-through estimator: the gradient passes as it is


DEFENCE_MODELS: tuple[type[DefenceParams], ...] = (NoDefence, NoiseDefence, NopeekDefence, QuantizeDefence)
DefenceConfig = Annotated[Union[DEFENCE_MODELS], Field(discriminator="kind")]  # noqa: UP007
DEFENCES = {m.model_fields["kind"].annotation.__args__[0]: m.model_fields["kind"].description.split(": ", 1)[1]
            for m in DEFENCE_MODELS}


class AttackParams(BaseModel):
    """An attack's keys under ``privacy.attack``: one model per attack plug-in (its ``Params``), picked by
    ``kind``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    KIND: ClassVar[str] = "attack"


class NoAttack(AttackParams):
    kind: Literal["none"] = Field(default="none", description="none: no attack")


class ScoredAttack(AttackParams):
    """What every reconstruction attack is scored on."""

    victims: int = Field(default=2, ge=1, description="scored on clients 0 .. victims-1")
    samples: int = Field(default=64, ge=1, description="training inputs scored per victim")


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
    # 0 where either is constant, chosen on the device (no read of denom); the other branch kept finite there so
    # that its gradient, multiplied by zero, stays zero
    ok = denom > 0
    value = (dcov2_xy.clamp_min(0) / torch.where(ok, denom, torch.ones_like(denom)) + (~ok).double()).sqrt()
    return torch.where(ok, value, torch.zeros_like(value))


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
        with _quiet_library():
            self._acc.compose(ev if q == 1 else self._event.PoissonSampledDpEvent(q, ev), int(steps))

    def epsilon(self, delta: float) -> float:
        with _quiet_library():
            return float(self._acc.get_epsilon(delta))


@contextlib.contextmanager
def _quiet_library():
    """dp_accounting logs a warning for each fractional order whose series does not converge (small sigma) and
    leaves that order out of the bound; the warnings are silenced, the result is the library's."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def quantize(z: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """``z`` rounded to ``2**bits`` evenly spaced levels between its min and max (what the server receives,
    dequantized) and the bytes that carries: ``bits`` per value plus the two float32 bounds."""
    if not 1 <= bits <= 16:
        raise ValueError(f"quantize: bits must be in 1..16, got {bits}")
    lo, hi = z.min(), z.max()
    levels = 2 ** bits - 1
    step = torch.where(hi > lo, (hi - lo) / levels, torch.ones((), dtype=z.dtype, device=z.device))  # no read
    q = torch.round((z - lo) / step).clamp(0, levels)
    return lo + q * step, quantized_nbytes(z.numel(), bits)


def quantized_nbytes(numel: int, bits: int) -> int:
    """What ``quantize`` sends for ``numel`` values: ``bits`` each, plus the two float32 bounds."""
    return (numel * bits + 7) // 8 + 8


@dataclass(frozen=True)
class PrivacySpec:
    """The ``privacy`` config section as the hosts get it: its typed ``defence`` and ``attack`` sections, and what
    the driver derived for them from the data. ``aux_x``: the public images an attack that ``needs_aux`` is fitted
    on (raw, as the dataset stores them); ``input_range``: for an attack that ``needs_held_model``, two raw inputs,
    the smallest and the largest value of each channel over the test set (the range it keeps its inversion in);
    ``victims``: the clients whose training inputs the attack is scored on."""

    defence: DefenceParams = NoDefence()
    attack: AttackParams = NoAttack()
    aux_x: np.ndarray | None = None
    input_range: np.ndarray | None = None
    victims: tuple[int, ...] = ()

    @property
    def accounted(self) -> bool:
        """Whether the defence spends a privacy budget an accountant can count (noise with a clip)."""
        d = self.defence
        return d.kind == "noise" and d.sigma > 0 and d.clip is not None


class CutDefence:
    """A client's side of the cut under ``privacy.defence``: ``release`` turns the activation ``z`` into what is
    sent (the graph kept through the clip and, for quantization, a straight-through estimator, so the server's
    gradient reaches the client part) and the bytes it takes (None: the float tensor's own); ``loss`` is NoPeek's
    term on (inputs, activation) or None; ``epsilon`` the budget a client has spent after its releases."""

    def __init__(self, spec: PrivacySpec):
        self.spec = spec
        self.params = spec.defence  # the defence's own section (``kind`` and its keys)

    def release(self, z):
        """A language model's :class:`~raysplit.models.causal_lm.HiddenStates` payload is defended on its hidden
        tensor alone: the attention mask and positions cross as they are (public structure, no gradient), their
        bytes added to the hidden tensor's where the defence charges its own."""
        if hasattr(z, "hidden") and hasattr(z, "attention_mask"):
            hidden, nbytes = self.params.release(z.hidden)
            rest = z.attention_mask.numel() * z.attention_mask.element_size() + \
                z.positions.numel() * z.positions.element_size()
            return type(z)(hidden, z.attention_mask, z.positions), (None if nbytes is None else nbytes + rest)
        return self.params.release(z)

    def loss(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """NoPeek's term (``defend`` keeps (x, z) only under nopeek, whose alpha the config holds above 0)."""
        return nopeek_loss(x, z, self.params.alpha)

    def epsilon(self, releases: dict[float, int]) -> float:
        """Epsilon at the noise defence's ``delta`` after ``releases`` ({sampling rate: count}); 0 before any
        release. Clients with the same releases (every client of a full-participation round) share one
        accountant's computation."""
        return _epsilon(self.params.sigma, self.params.delta, tuple(sorted(releases.items())))


@functools.lru_cache(maxsize=4096)
def _epsilon(sigma: float, delta: float, releases: tuple[tuple[float, int], ...]) -> float:
    if not releases:
        return 0.0
    acc = GaussianAccountant(sigma)
    for q, n in releases:
        acc.record(min(q, 1.0), n)
    return acc.epsilon(delta)


class _Decoder(torch.nn.Module):
    """Ridge regression from activations to inputs (fitted in closed form) plus an MLP on what it leaves."""

    def __init__(self, z_ref: torch.Tensor, coef: torch.Tensor, mean: torch.Tensor, mlp: torch.nn.Module):
        super().__init__()
        self.register_buffer("z_ref", z_ref)
        self.register_buffer("coef", coef)
        self.register_buffer("mean", mean)
        self.mlp = mlp

    def linear(self, z: torch.Tensor) -> torch.Tensor:
        return (z @ self.z_ref.T) @ self.coef + self.mean

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z.reshape(len(z), -1).float()
        return self.linear(z) + self.mlp(z)


def train_decoder(z: torch.Tensor, x: torch.Tensor, epochs: int, hidden: int, seed: int,
                  batch: int = 64, lr: float = 1e-3, ridge: float = 1e-3) -> torch.nn.Module:
    """The attacker's inverse network (He et al. 2019's query-free attack, fitted on (activation, input) pairs of
    the auxiliary set): ridge regression from flattened activations to flattened inputs, in closed form (its dual,
    so wide activations cost n x n), with ``ridge`` x the kernel's mean diagonal as its penalty; then an MLP
    (``hidden`` units) fitted with Adam on the mean squared error of what the linear map leaves, ``epochs``
    passes. Deterministic in ``seed``. Returns a module from activations (any shape) to flattened inputs."""
    g = torch.Generator().manual_seed(seed)
    zf = z.detach().reshape(len(z), -1).double()
    xf = x.detach().reshape(len(x), -1).double()
    mean = xf.mean(0)
    k = zf @ zf.T
    lam = ridge * float(k.diagonal().mean().clamp_min(1e-12))
    coef = torch.linalg.solve(k + lam * torch.eye(len(k), dtype=k.dtype), xf - mean)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = torch.nn.Sequential(torch.nn.Linear(zf.shape[1], hidden), torch.nn.ReLU(),
                                  torch.nn.Linear(hidden, xf.shape[1]))
    dec = _Decoder(zf.float(), coef.float(), mean.float(), mlp)
    zf, rest = zf.float(), (xf - dec.linear(zf.float()).double()).float()
    opt = torch.optim.Adam(mlp.parameters(), lr=lr)
    for _ in range(epochs):
        for idx in torch.randperm(len(zf), generator=g).split(batch):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(mlp(zf[idx]), rest[idx]).backward()
            opt.step()
    return dec.eval()


def invert_activations(encode, z: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, steps: int, lr: float,
                       tv: float) -> torch.Tensor:
    """He et al. 2019's white-box model inversion (regularized maximum likelihood estimation, their "rMLE"): the
    inputs whose encoding by ``encode`` (the client part the attacker holds: under SFL the averaged client model
    the server computes) is closest to the activations ``z`` the client sent, in squared error per sample, plus
    ``tv`` times each image's total variation (torchmetrics), their prior that images are smooth. Adam on the
    inputs for ``steps`` steps at ``lr``, from the middle of the input range and kept inside it (``lo``, ``hi``:
    the smallest and largest value a pixel can take, shape (1, C, H, W): public, as the normalisation is); no
    randomness. Only the inputs are differentiated: the module's parameters are read, not changed."""
    from torchmetrics.functional.image import total_variation

    target = z.detach().reshape(len(z), -1).float()
    x = ((lo + hi) / 2).expand(len(z), *lo.shape[1:]).clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)
    for _ in range(steps):
        loss = (encode(x).reshape(len(z), -1) - target).pow(2).sum(1).mean()
        if tv > 0:
            loss = loss + tv * total_variation(x, reduction="mean")
        (x.grad,) = torch.autograd.grad(loss, [x])
        opt.step()
        with torch.no_grad():
            x.copy_(torch.maximum(torch.minimum(x, hi), lo))
    return x.detach()


@torch.no_grad()
def reconstruction_scores(x: torch.Tensor, x_hat: torch.Tensor) -> dict[str, float]:
    """How close reconstructions ``x_hat`` are to the images ``x`` (N, C, H, W): SSIM and PSNR (torchmetrics),
    both on the data range of ``x`` (reconstructions clamped to it), and the mean squared error."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    x, x_hat = x.float(), x_hat.reshape(x.shape).float()
    lo, hi = float(x.min()), float(x.max())
    xh = x_hat.clamp(lo, hi)
    k = min(11, *(d - (1 - d % 2) for d in x.shape[2:]))  # an odd window no larger than the image
    return {"ssim": float(structural_similarity_index_measure(xh, x, data_range=(lo, hi), kernel_size=k)),
            "psnr": float(peak_signal_noise_ratio(xh, x, data_range=(lo, hi))),
            "mse": float(torch.nn.functional.mse_loss(x_hat, x))}


@dataclass
class AttackView:
    """What an attack plug-in gets for one victim (all of it the server's to know but ``z_victim``'s inputs, which
    only the score uses): ``z_victim``, what the victim sends for the inputs scored; ``aux`` and ``z_aux``, the
    public auxiliary inputs and what the victim's client part sends for them (where the attack ``needs_aux``);
    ``held``, the averaged client model's encoder the server holds (where it ``needs_held_model``); ``lo``,
    ``hi``, the input range per channel (1, C, H, W); ``seed``, for an attack that draws randomness. On a
    language model (an attack that is ``language_model``): ``z_victim`` the hidden states ``(B, T, D)`` the victim
    sends for its token blocks, ``public`` the public base's client part (the client part as the run started:
    the pretrained or initial weights every side loads, no client's adapters), ``aux`` public token blocks and
    ``z_aux`` what that public part sends for them through the client's defence, ``vocab`` the vocabulary's
    size."""

    z_victim: torch.Tensor
    aux: torch.Tensor | None = None
    z_aux: torch.Tensor | None = None
    held: object = None
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    seed: int = 0
    public: object = None
    vocab: int = 0


class Attack:
    """A server-side attack plug-in (``privacy.attack.kind``): from what the server receives from a victim, the
    victim's inputs. ``needs_aux``: fitted on the auxiliary public set encoded through the victim's client part;
    ``needs_held_model``: works through the averaged client model the server holds (refused, before any actor
    starts, under a method that averages none). The runtime's client host builds the view (it alone holds the
    ground truth the score needs) and scores what ``reconstruct`` returns."""

    name = ""
    description = ""
    Params: ClassVar[type[ScoredAttack]] = ScoredAttack  # its keys under privacy.attack (kind: its name)
    needs_aux = False
    needs_held_model = False
    language_model = False  # recovers token ids from a language model's hidden states (token_recovery)

    def __init__(self, spec: PrivacySpec):
        self.spec = spec
        self.params = spec.attack

    def reconstruct(self, view: AttackView) -> torch.Tensor:
        raise NotImplementedError


class InverseNetwork(Attack):
    """He et al., "Model inversion attacks against collaborative inference" (ACSAC 2019), the query-free attack: an
    inverse network fitted on (activation, input) pairs of public data (:func:`train_decoder`)."""

    name = "reconstruction"
    description = ("input reconstruction from activations: a decoder trained on an auxiliary public set (the test "
                   "set's last aux_size images) through the client part; SSIM/PSNR/MSE on clients' training inputs "
                   "it never saw (He et al., 'Model inversion attacks against collaborative inference', ACSAC 2019, "
                   "the query-free 'inverse network')")
    needs_aux = True

    class Params(ScoredAttack):
        kind: Literal["reconstruction"] = Field(description="reconstruction: a decoder fitted on the auxiliary set")
        aux_size: int = Field(default=1000, ge=10, description="the attacker's auxiliary set, the test set's last "
                              "aux_size inputs")
        epochs: int = Field(default=10, ge=0, description="the decoder MLP's passes over the auxiliary set (after "
                            "its closed-form linear part)")
        hidden: int = Field(default=512, ge=1, description="the decoder MLP's hidden units")

    def reconstruct(self, view: AttackView) -> torch.Tensor:
        dec = train_decoder(view.z_aux, view.aux, self.params.epochs, self.params.hidden, seed=view.seed)
        with torch.no_grad():
            return dec(view.z_victim)


class WhiteBoxInversion(Attack):
    """He et al. 2019's white-box attack (regularized maximum likelihood estimation) through the averaged client
    model the server holds (:func:`invert_activations`)."""

    name = "inversion"
    description = ("model inversion through the averaged client model the server holds: inputs optimised until "
                   "that model maps them to what the client sent (He et al. 2019's white-box attack, regularized "
                   "maximum likelihood estimation); SSIM/PSNR/MSE on clients' training inputs; needs a method that "
                   "averages client models on the server (not psl)")
    needs_held_model = True

    class Params(ScoredAttack):
        kind: Literal["inversion"] = Field(description="inversion: inputs optimised through the averaged client "
                                           "model")
        steps: int = Field(default=200, ge=1, description="Adam steps on the inputs")
        lr: float = Field(default=0.1, gt=0, description="Adam's learning rate on the inputs")
        tv: float = Field(default=0.1, ge=0, description="weight of the total-variation prior")

    def reconstruct(self, view: AttackView) -> torch.Tensor:
        p = self.params
        return invert_activations(view.held, view.z_victim, view.lo, view.hi, p.steps, p.lr, p.tv)


class NearestEmbedding(Attack):
    """Token recovery by the nearest row of the public embedding table
    (:func:`~raysplit.token_privacy.nearest_tokens`), the embedding-inversion baseline of SplitLLM (Chen et al.,
    CCS 2024)."""

    name = "nearest_embedding"
    description = ("language models: each position's hidden state at the cut matched to the nearest row of the "
                   "public embedding table (after removing the public positional embedding); exact at cut embed "
                   "without a defence, weaker deeper; privacy/token_recovery (SplitLLM's embedding-inversion "
                   "baseline, Chen et al., CCS 2024)")
    language_model = True

    class Params(ScoredAttack):
        kind: Literal["nearest_embedding"] = Field(description="nearest_embedding: the nearest public embedding row")
        metric: Literal["cosine", "l2"] = Field(default="cosine", description="cosine or l2 distance to the rows")
        remove_positions: bool = Field(default=True, description="subtract the public positional embedding first "
                                       "(GPT-2's learned positions; Llama's are rotary, nothing to subtract)")

    def reconstruct(self, view: AttackView) -> torch.Tensor:
        from raysplit.token_privacy import embed_block, embedding_tables, nearest_tokens

        table, positions = embedding_tables(embed_block(view.public))
        return nearest_tokens(view.z_victim, table, self.params.metric,
                              positions if self.params.remove_positions else None)


class TokenInversion(Attack):
    """SplitLLM's learned inversion (Chen et al., CCS 2024; StupidTrees/SplitLLM), reduced to one position at a
    time: a decoder from hidden states to tokens trained on public text encoded through the public base and the
    client's defence (:func:`~raysplit.token_privacy.train_token_decoder`)."""

    name = "token_inversion"
    description = ("language models: a small decoder from hidden states to tokens, trained on public text (the "
                   "test set's last aux_size blocks) encoded through the public base's client part and the "
                   "client's defence, applied to what the victim sends; privacy/token_recovery (SplitLLM's "
                   "learned inversion, Chen et al., CCS 2024, per position)")
    language_model = True
    needs_aux = True

    class Params(ScoredAttack):
        kind: Literal["token_inversion"] = Field(description="token_inversion: a decoder trained on public text")
        aux_size: int = Field(default=32, ge=1, description="the attacker's public text, the test set's last "
                              "aux_size token blocks")
        epochs: int = Field(default=20, ge=1, description="the decoder's passes over the public positions")
        hidden: int = Field(default=256, ge=1, description="the decoder MLP's hidden units")
        lr: float = Field(default=3e-3, gt=0, description="the decoder's Adam learning rate")

    def reconstruct(self, view: AttackView) -> torch.Tensor:
        from raysplit.token_privacy import train_token_decoder

        p = self.params
        dec = train_token_decoder(view.z_aux, view.aux, view.vocab, p.epochs, p.hidden, seed=view.seed, lr=p.lr)
        return dec.tokens(view.z_victim)


ATTACK_PLUGINS: dict[str, type[Attack]] = {a.name: a for a in (InverseNetwork, WhiteBoxInversion, NearestEmbedding,
                                                                TokenInversion)}
ATTACKS = {"none": "no attack", **{n: a.description for n, a in ATTACK_PLUGINS.items()}}
AttackConfig = Annotated[Union[(NoAttack, *(a.Params for a in ATTACK_PLUGINS.values()))],  # noqa: UP007
                         Field(discriminator="kind")]


def privacy_spec(section, method: str, keeps_global: bool, cut: int | None, dataset: str, input_shape: tuple,
                 x_te: np.ndarray, num_clients: int, lm=None) -> PrivacySpec | None:
    """The ``privacy`` config ``section`` as the hosts get it (None: off), checked against the method (its name,
    whether it keeps a global client model, its cut) and the data (``dataset``, the per-sample ``input_shape``, the
    test inputs ``x_te``) before any actor starts: a defence or an attack needs a cut whose activations reach the server; the reconstruction
    attack needs images and an auxiliary set the test set can give; the inversion attack needs images and an
    averaged client model on the server (not psl); NoPeek needs the client's loss, which Ampere's device phase
    (its own local loss) does not take yet. ``lm``: the run's ``model.lm`` section (None: a model of the zoo): the
    token attacks (``language_model``) need one, split U-shaped (a plain split sends the text to the server as
    labels, so there is nothing to recover), and the image attacks refuse one."""
    d, a = section.defence, section.attack
    if d.kind == "none" and a.kind == "none":
        return None
    on = "privacy.attack.kind" if a.kind != "none" else "privacy.defence.kind"
    if cut is None:
        raise ConfigError(f"{on}: {method} sends no activations to a server (no cut); nothing to "
                          f"{'attack' if on.endswith('attack.kind') else 'defend'} at the cut")
    if d.kind == "nopeek" and method == "ampere":
        raise ConfigError("privacy.defence.kind=nopeek: ampere's device phase trains on its own auxiliary loss, "
                          "which the NoPeek term is not added to (noise and quantize apply to its one-shot export)")
    aux, plugin = None, ATTACK_PLUGINS.get(a.kind)
    if a.kind != "none":
        if plugin is not None and plugin.language_model:
            if lm is None:
                images = ", ".join(n for n, p in ATTACK_PLUGINS.items() if not p.language_model)
                raise ConfigError(f"privacy.attack.kind={a.kind} recovers tokens from a language model's hidden "
                                  f"states (model.lm); this run's model is an image model on {dataset} (its image "
                                  f"attacks: {images})")
            if lm.split == "plain":
                raise ConfigError(f"privacy.attack.kind={a.kind}: model.lm.split=plain sends the token blocks to "
                                  f"the server as labels, so the server has the text and there is nothing to "
                                  f"recover; token recovery is measured on model.lm.split=u_shaped")
        elif len(input_shape) != 3:
            hint = (f" (a language model: {', '.join(n for n, p in ATTACK_PLUGINS.items() if p.language_model)})"
                    if lm is not None else "")
            raise ConfigError(f"privacy.attack.kind={a.kind} scores images (channels, height, width); "
                              f"{dataset}'s inputs have shape {input_shape}{hint}")
        if a.victims > num_clients:
            raise ConfigError(f"privacy.attack.victims={a.victims} is more than the {num_clients} clients")
    if plugin is not None and plugin.needs_aux:
        if a.aux_size >= len(x_te):
            raise ConfigError(f"privacy.attack.aux_size={a.aux_size} must be smaller than the test set "
                              f"({len(x_te)} inputs): the auxiliary set is the test set's last aux_size inputs")
        aux = np.ascontiguousarray(x_te[len(x_te) - a.aux_size:])
    input_range = None
    if plugin is not None and plugin.needs_held_model:
        if not keeps_global:
            raise ConfigError(f"privacy.attack.kind={a.kind} works through the averaged client model the server "
                              f"holds; {method} never averages client models (each client keeps its own), so the "
                              f"server has none to invert (privacy.attack.kind=reconstruction needs no client model)")
        axes = (0, *range(2, x_te.ndim))  # the input range it keeps to: the test set's, per channel
        input_range = np.ascontiguousarray(np.stack([
            np.broadcast_to(x_te.min(axis=axes, keepdims=True)[0], x_te.shape[1:]),
            np.broadcast_to(x_te.max(axis=axes, keepdims=True)[0], x_te.shape[1:])]))
    return PrivacySpec(defence=d, attack=a, aux_x=aux, input_range=input_range,
                       victims=tuple(range(getattr(a, "victims", 0))))
