"""Virtual clock building blocks: client speed/bandwidth profiles and a cached FLOP counter.

Simulated time is charged as FLOPs / FLOP/s for compute and bytes / (bytes/s) for transfers, so results do not
depend on the machine that runs the simulation. FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``
(which counts matmuls and convolutions), measured once per (model part, input shape) and cached.

Profiles (``clock.profile``):
- ``homogeneous``: every client has ``client_flops`` and ``up/down_bandwidth``.
- ``uniform``: FLOP/s ~ U(client_flops_range), bandwidths ~ U(up_range), U(down_range).
- ``gas_cell``: GAS's model (seed-code.md §1.6): FLOP/s ~ U(1e9, 1e10); distance d ~ U(0.1, 1) km; path loss
  128.1 + 37.6 log10(d) dB; rate W log2(1 + P h / (W N0)) bit/s with W = 10 MHz, P = 0.2 W, N0 = -174 dBm/Hz.
  GAS models the uplink only; we use the same rate for the downlink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class ClientProfile:
    """A client's speeds, and the one clock arithmetic: the client hosts charge with it (``ClientHost.charge_*``)
    and the asynchronous mode predicts with it (``events.ClientCosts``)."""

    flops: float  # FLOP/s
    up: float  # bytes/s
    down: float  # bytes/s

    def after_compute(self, t: float, flops: float) -> float:
        """The clock after ``flops`` of work started at ``t``."""
        return t + flops / self.flops

    def after_upload(self, t: float, nbytes: float) -> float:
        """The clock after sending ``nbytes`` from ``t`` on."""
        return t + nbytes / self.up

    def seconds(self, flops: float = 0.0, up_bytes: float = 0.0, down_bytes: float = 0.0) -> float:
        """How long ``flops`` of work, sending ``up_bytes`` and receiving ``down_bytes`` take one after another
        (a method's own timing model: MergeSFL's per-sample time)."""
        return self.after_download(self.after_upload(self.after_compute(0.0, flops), up_bytes), 0.0, down_bytes)

    def after_download(self, t: float, t_sent: float, nbytes: float, charged: bool = True) -> float:
        """The clock once a message of ``nbytes`` sent at ``t_sent`` has arrived at a client whose clock is ``t``
        (it may still be busy); ``charged`` false (GAS's code, ``clock.charge_server: false``): no transfer time."""
        return max(t, t_sent) + (nbytes / self.down if charged else 0.0)


def gas_cell_rate(distance_km: np.ndarray, bandwidth_hz=1e7, power_w=0.2, n0_w_per_hz=3.981e-21) -> np.ndarray:
    """Uplink rate in bit/s for GAS's cell model."""
    path_loss_db = 128.1 + 37.6 * np.log10(distance_km)
    h = 10.0 ** (-path_loss_db / 10.0)
    return bandwidth_hz * np.log2(1.0 + power_w * h / (bandwidth_hz * n0_w_per_hz))


class ClockProfile(BaseModel):
    """The ``clock`` section: the server's speed and whether its work costs time (every profile's), and how the
    clients' speeds are drawn, one model per profile picked by ``profile`` (a key another profile takes is an error
    naming it). Owned here, with the arithmetic: :meth:`draw` gives every client its :class:`ClientProfile`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    KIND: ClassVar[str] = "clock profile"  # what an error calls the member that ``profile`` picked
    server_flops: float = Field(default=1e12, gt=0, description="the server's FLOP/s")
    charge_server: bool = Field(default=True, description="server compute and gradient/model downloads cost "
                                "simulated time (false: only client compute and uploads, as GAS's code)")

    def draw(self, num_clients: int, rng: np.random.Generator) -> list[ClientProfile]:
        """Per-client profiles drawn deterministically from ``rng``."""
        f, up, down = self._draw(num_clients, rng)
        return [ClientProfile(float(a), float(b), float(c)) for a, b, c in zip(f, up, down)]

    def _draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError


class HomogeneousClock(ClockProfile):
    profile: Literal["homogeneous"] = Field(default="homogeneous", description="homogeneous: every client has "
                                            "client_flops and up/down_bandwidth")
    client_flops: float = Field(default=1e10, gt=0, description="FLOP/s")
    up_bandwidth: float = Field(default=1e7, gt=0, description="upload bytes/s")
    down_bandwidth: float = Field(default=1e7, gt=0, description="download bytes/s")

    def _draw(self, n, rng):
        return np.full(n, self.client_flops), np.full(n, self.up_bandwidth), np.full(n, self.down_bandwidth)


class UniformClock(ClockProfile):
    profile: Literal["uniform"] = Field(description="uniform: FLOP/s and bandwidths drawn uniformly from ranges")
    client_flops_range: tuple[float, float] = Field(default=(1e9, 1e10), description="FLOP/s range")
    up_range: tuple[float, float] = Field(default=(1e6, 1e7), description="upload bytes/s range")
    down_range: tuple[float, float] = Field(default=(1e6, 1e7), description="download bytes/s range")

    def _draw(self, n, rng):
        return (rng.uniform(*self.client_flops_range, size=n), rng.uniform(*self.up_range, size=n),
                rng.uniform(*self.down_range, size=n))


class GasCellClock(ClockProfile):
    profile: Literal["gas_cell"] = Field(description="gas_cell: GAS's cell model (FLOP/s ~ U(1e9, 1e10); the rate "
                                         "from a distance ~ U(0.1, 1) km, both ways)")

    def _draw(self, n, rng):
        f = rng.uniform(1e9, 1e10, size=n)
        rate_bytes = gas_cell_rate(rng.uniform(0.1, 1.0, size=n)) / 8.0
        return f, rate_bytes, rate_bytes


CLOCK_PROFILES: tuple[type[ClockProfile], ...] = (HomogeneousClock, UniformClock, GasCellClock)
ClockConfig = Annotated[Union[CLOCK_PROFILES], Field(discriminator="profile")]  # noqa: UP007


class FlopCache:
    """FLOPs of forward and backward passes, measured once per key (part name + input shape) and cached."""

    def __init__(self):
        self._cache: dict[tuple, int] = {}

    def run(self, key: tuple, fn, batch: int | None = None):
        """Run ``fn()``; on the first call for ``key`` count its FLOPs. Returns (result, flops).

        ``batch``: for computations whose batch size varies from call to call (GAS's server updates over real and
        generated activations): the FLOPs of layers that treat the leading dimension as the batch (convolutions,
        linear maps, matmuls) are linear in it, so they are counted once per key and scaled by ``batch``."""
        if batch is not None:
            key = (key, "per_sample")
            if key not in self._cache:
                out, fl = _counted(fn)
                self._cache[key] = fl / batch
                return out, int(round(self._cache[key] * batch))
            return fn(), int(round(self._cache[key] * batch))
        if key in self._cache:
            return fn(), self._cache[key]
        out, fl = _counted(fn)
        self._cache[key] = int(fl)
        return out, self._cache[key]

    def __contains__(self, key: tuple) -> bool:
        return key in self._cache

    def count(self, key: tuple, fn) -> int:
        """The FLOPs cached for ``key``, counted by running ``fn()`` once if there are none yet: for a computation
        charged as what it stands for (a batched step of server copies, as the per-copy steps it replaces)."""
        if key not in self._cache:
            self._cache[key] = int(_counted(fn)[1])
        return self._cache[key]


def _counted(fn) -> tuple:
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, counter.get_total_flops()


def nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.element_size() * t.nelement()
    return int(np.asarray(t).nbytes)
