"""The runtime: the only layer that knows Ray. Its folders say where their code runs:

- ``client/``: a client actor (or the local backend's process), one :class:`ClientHost` holding many virtual
  clients, assembled from components (data, meter, states, slots, steps, pooled, jobs, transfers, moves, cut, tail,
  executor);
- ``server/``: the server actor: the :class:`ServerHost` (trainer, models, evaluation, screen, the U-shape's middle),
  the asynchronous host with its event loop (``server/events.py``), and the step engine that runs a round's split and
  pooled steps where the server lives (``server/stepping.py``);
- ``driver/``: the driver's process: the :class:`Runtime` algorithms call (``driver/api.py``), the typed host calls
  (``driver/calls.py``), the round and event drivers with fault recovery (``driver/drivers.py``), placement,
  snapshots, the driver-chained ports, the local backend;
- ``ray/``: Ray itself (the only files that import it, loaded when a Ray backend is asked for): the backend, the
  actors, their crew and pool, the resources.

At the top, what they share: the messages and their wire format (``messages.py``, ``transport.py``), what hosts
are built from (``plan.py``), what rules see and are (``contexts.py``, ``rules.py``), hosts' state (``state.py``),
devices (``devices.py``), unusable input (``screening.py``), the evaluation loop, aggregation, optimizers, batched
copies and the spill store. Algorithms import from here (this module's names and ``runtime.messages``), never a
folder.
"""

from raysplit.runtime.client.host import ClientHost
from raysplit.runtime.devices import host_device
from raysplit.runtime.driver.api import RoundStats, Runtime, RuntimeInputs
from raysplit.runtime.driver.calls import HostCalls
from raysplit.runtime.driver.drivers import EventDriver, RoundDriver
from raysplit.runtime.driver.local import LocalBackend
from raysplit.runtime.evaluation import EvalTally, predict_batches
from raysplit.runtime.messages import Activation, Batch, Gradient, StateMsg, Tag, batch_step
from raysplit.runtime.plan import HostPlan, Method, ModelFacts, Sections
from raysplit.runtime.rules import AsyncRule, ClientRule, ServerRule
from raysplit.runtime.screening import NonFiniteLossError
from raysplit.runtime.server.events import Job
from raysplit.runtime.server.host import ServerHost
from raysplit.runtime.state import Checkpointed, ModelSlot
from raysplit.runtime.transport import read_floats


def make_backend(rcfg):
    """Backend for a RuntimeConfig: ``ray`` (actors) or ``local`` (in-process; a device this process lacks is
    refused here, before any host is built)."""
    if rcfg.backend == "local":
        for role in ("server", "client"):
            host_device(getattr(rcfg, role).device, f"runtime.{role}.device")
        return LocalBackend(rcfg.num_workers)
    from raysplit.runtime.ray.backend import RayBackend

    return RayBackend(rcfg)


def runtime_for(rcfg, inputs: RuntimeInputs, backend=None) -> Runtime:
    """The Runtime a RuntimeConfig describes (its transport's flow control, its placement strategy) over
    ``backend`` (default: ``make_backend(rcfg)``)."""
    return Runtime(backend or make_backend(rcfg), inputs, rcfg.transport.max_in_flight, rcfg.transport.window,
                   rcfg.placement.strategy)


__all__ = ["Activation", "AsyncRule", "Batch", "Checkpointed", "ClientHost", "ClientRule", "EvalTally", "Gradient",
           "EventDriver", "HostCalls", "HostPlan", "Job", "LocalBackend", "Method", "ModelFacts", "ModelSlot", "NonFiniteLossError",
           "RoundDriver", "RoundStats", "Runtime", "RuntimeInputs", "Sections", "ServerHost", "ServerRule", "StateMsg", "Tag",
           "batch_step", "make_backend", "predict_batches", "read_floats", "runtime_for"]
