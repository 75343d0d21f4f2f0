"""Runtime layer: hosts (what runs in actors), the algorithm-facing API, drivers and the backends.

Only ``raysplit.runtime.ray_backend`` and its ``ray_actors``, ``ray_crew``, ``ray_pool`` and ``ray_resources``
import Ray; they are loaded when a Ray backend is requested.
"""

from raysplit.runtime.api import HostCalls, LocalBackend, RoundStats, Runtime, RuntimeInputs
from raysplit.runtime.hostspec import host_device
from raysplit.runtime.hosts import Checkpointed, ClientHost, ModelSlot, NonFiniteLossError, ServerHost
from raysplit.runtime.plan import HostPlan, Method, ModelFacts, Sections
from raysplit.runtime.rules import AsyncRule, ClientRule, ServerRule
from raysplit.runtime.messages import Activation, Batch, Gradient, StateMsg, Tag, batch_step


def make_backend(rcfg):
    """Backend for a RuntimeConfig: ``ray`` (actors) or ``local`` (in-process; a device this process lacks is
    refused here, before any host is built)."""
    if rcfg.backend == "local":
        for role in ("server", "client"):
            host_device(getattr(rcfg, role).device, f"runtime.{role}.device")
        return LocalBackend(rcfg.num_workers)
    from raysplit.runtime.ray_backend import RayBackend

    return RayBackend(rcfg)


def runtime_for(rcfg, inputs: RuntimeInputs, backend=None) -> Runtime:
    """The Runtime a RuntimeConfig describes (its transport's flow control, its placement strategy) over
    ``backend`` (default: ``make_backend(rcfg)``)."""
    return Runtime(backend or make_backend(rcfg), inputs, rcfg.transport.max_in_flight, rcfg.transport.window,
                   rcfg.placement.strategy)


__all__ = ["Activation", "AsyncRule", "Batch", "Checkpointed", "ClientHost", "ClientRule", "Gradient", "HostCalls", "HostPlan", "LocalBackend", "Method", "ModelFacts", "Sections",
           "ModelSlot", "NonFiniteLossError", "RoundStats", "Runtime", "RuntimeInputs", "ServerHost", "ServerRule", "StateMsg", "Tag",
           "batch_step", "make_backend", "runtime_for"]
