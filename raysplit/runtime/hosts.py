"""What runs inside the actors: a client host (many virtual clients) and a server host. No Ray here.

The Ray backend wraps these classes in actors; the local backend calls them in-process. Algorithms that need other
server or client behaviour subclass them (``Algorithm.server_host`` / ``client_host``) and add methods, which the
runtime reaches through ``rt.server.<method>(...)``, ``rt.client(cid).<method>(...)`` and
``rt.workers.<method>(...)`` (names checked against the host class on the driver, at the call).

Client host state, per virtual client it holds: its own model weights when the algorithm keeps un-aggregated client
models (``persist_client_models``), its optimizer state (persists across rounds, as in CycleSL's code), its data
cursor (epoch and position in a permutation drawn from (seed, client, epoch)), its simulated clock and its
byte/FLOP counters. Model weights and optimizer states live in a :class:`~raysplit.runtime.spill.SpillStore`
(``runtime.client_state_mb``: beyond that budget the least recently used go to disk). A client's state moves
between hosts when the runtime places it elsewhere for a round (``export_clients`` / ``import_clients``,
``runtime/placement.py``); its randomness (dropout, augmentation) is drawn per (client, round, step), so where it
runs changes nothing. A client being trained in the current round holds a module instance of its own (a
:class:`ModelSlot`), so a forward's autograd graph stays alive in the host until the gradient with the same tag
arrives; slots are released at the end of the round.

Every server-side training computation goes through :meth:`ServerHost.step_through` (one forward, loss, backward,
finite check, optimizer steps, FLOPs on the clock, busy time), whatever the family: split steps, CycleSL's pooled
resampling and frozen-server gradients, SGLR's concatenated step, Hydra's heads. The one exception is
:meth:`ServerHost.train_copies` under ``runtime.batched_copies``: the forward and backward of several per-client
copies run as one batched computation (:mod:`raysplit.runtime.batched`), and each copy's step is then completed
by the same code (:meth:`ServerHost.settle_step`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import time
import warnings
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import threadpoolctl
import torch
import torch.nn.functional as F

from raysplit.clock import ClientProfile, FlopCache
from raysplit.errors import BadClientInput
from raysplit.data import DataSpec, to_tensor
from raysplit.runtime import batched, transport
from raysplit.runtime.aggregation import average_optimizer_states, average_states, finish_average, weighted_sum
from raysplit.runtime.messages import Activation, Gradient, StateMsg, Tag
from raysplit.runtime.optim import make_optimizer, round_lr, set_lr
from raysplit.runtime.spill import SpillStore, StoreView


class NonFiniteLossError(RuntimeError):
    """A loss became NaN or inf; the message names the round and client."""


class NonFiniteInput(NonFiniteLossError, BadClientInput):
    """A NaN or inf activation or gradient under ``on_bad_client: fail``: a client's fault and, like a non-finite
    loss, what a diverged run shows (a sweep reports it as diverged, not as a failure to retry)."""


def _bad_input(where: str, why: str) -> BadClientInput:
    return (NonFiniteInput if "NaN or inf" in why else BadClientInput)(f"{where}: {why}")


@dataclass(frozen=True)
class HostSpec:
    """Everything a host needs to build itself; prepared once on the driver and shipped to every actor."""

    model: str
    num_classes: int
    input_shape: tuple
    model_options: dict
    cut: int | None  # None: the client holds the whole model (FedAvg)
    client_optimizer: dict
    server_optimizer: dict
    data_spec: DataSpec
    batch_size: int
    seed: int
    eval_batch_size: int = 1000
    torch_threads: int | None = 1
    device: str = "cpu"
    server_flops: float = 1e12
    persist_client_models: bool = False  # no global client model: every client keeps its own
    stop_on_nonfinite: bool = True  # train.stop_on_nonfinite, on the client and the server path alike
    rounds: int = 1  # train.rounds (schedules that depend on the run's length, e.g. SGLR's comm_fraction)
    params: Any = None  # the algorithm's validated Params (``algorithm:`` section)
    host_setup: Any = None  # what the algorithm derived at setup for its hosts (``Algorithm.host_setup``)
    clip_grad_norm: float | None = None  # train.clip_grad_norm: clip every step's gradients (clients and server)
    asynchronous: bool = False  # run by the event driver: per-client RNG, forwards replayable from a checkpoint
    charge_server: bool = True  # server compute and downloads cost simulated time (False: GAS's code)
    on_bad_client: str = "fail"  # runtime.on_bad_client: a rejected activation/gradient fails the run or drops
    client_state_bytes: int | None = None  # runtime.client_state_mb: per client host, the rest spills to disk
    spill_dir: str | None = None  # runtime.spill_dir: where (None: the system's temporary directory)
    batched_copies: bool = False  # runtime.batched_copies: per-client server copies step in one batched computation


@dataclass
class ModelSlot:
    """A module with its optimizer: a client being trained this round, the server model, a copy or a head."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer


def build_parts(spec: HostSpec) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Client part and server part of the configured model (random init; callers load states)."""
    from raysplit.models import build_model

    model = build_model(spec.model, spec.num_classes, tuple(spec.input_shape), **spec.model_options)
    if spec.cut is None:
        return model, torch.nn.Identity()
    return model.split(spec.cut)


def advance_cursor(n: int, batch_size: int, cursor: tuple[int, int]) -> tuple[int, int, int]:
    """A client's next batch from its data cursor ``(epoch, position)``: ``(epoch, start, stop)`` in the epoch's
    permutation. A new epoch starts once the last (possibly short) batch is drawn."""
    epoch, pos = cursor
    if pos >= n:
        epoch, pos = epoch + 1, 0
    return epoch, pos, min(pos + batch_size, n)


def check_finite(loss: float, stop: bool, where: str) -> bool:
    """True if ``loss`` is finite; otherwise raise (``stop``, i.e. ``train.stop_on_nonfinite``) or return False."""
    if math.isfinite(loss):
        return True
    if stop:
        raise NonFiniteLossError(f"non-finite loss {loss} at {where}")
    return False


def _nonfinite(a: np.ndarray) -> str:
    bad = int(a.size - np.count_nonzero(np.isfinite(a)))
    return f"{bad} of {a.size} values are NaN or inf" if bad else ""


def activation_fault(act: Activation, shape: tuple, dtype: np.dtype, num_classes: int, rnd: int | None,
                     finite: bool = True) -> str:
    """What is wrong with an activation arriving at the server ('' if nothing): a tag from another round than
    ``rnd``, smashed data that is not an array of ``dtype`` with per-sample ``shape``, labels that do not match
    the batch (an empty label array is allowed: labels kept on the client) or lie outside ``[0, num_classes)``,
    non-finite values (when ``finite``)."""
    x, y = act.x, np.asarray(act.y)
    if rnd is not None and act.tag.round != rnd:
        return f"tagged with round {act.tag.round}, the server is serving round {rnd}"
    if not isinstance(x, np.ndarray):
        return f"activation is a {type(x).__name__}, not an array"
    if x.dtype != dtype:
        return f"activation dtype {x.dtype}, expected {dtype}"
    if x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != tuple(shape) or x.shape[0] == 0:
        return f"activation shape {tuple(x.shape)}, expected (batch, {', '.join(map(str, shape))})"
    if y.size:
        if y.shape != (x.shape[0],) or y.dtype.kind not in "iu":
            return f"labels of shape {y.shape} and dtype {y.dtype} for a batch of {x.shape[0]}"
        if y.min() < 0 or y.max() >= num_classes:
            return f"labels out of range [0, {num_classes}): min {y.min()}, max {y.max()}"
    return finite and _nonfinite(x) and "activation: " + _nonfinite(x)


def gradient_fault(g: np.ndarray, out: torch.Tensor, finite: bool = True) -> str:
    """What is wrong with a gradient arriving at a client for its activation ``out`` ('' if nothing)."""
    if not isinstance(g, np.ndarray):
        return f"gradient is a {type(g).__name__}, not an array"
    want = transport.pack(out[:0]).dtype
    if g.dtype != want or tuple(g.shape) != tuple(out.shape):
        return f"gradient of shape {tuple(g.shape)} and dtype {g.dtype}, expected {tuple(out.shape)} and {want}"
    return finite and _nonfinite(g) and "gradient: " + _nonfinite(g)


def screens_nonfinite(spec: HostSpec) -> bool:
    """NaN/inf inputs are screened unless the run lets them through (``train.stop_on_nonfinite: false`` with
    ``on_bad_client: fail``: a diverging run goes on, as asked)."""
    return spec.stop_on_nonfinite or spec.on_bad_client == "drop"


def where_of(tag: Tag) -> str:
    stream = f", stream {tag.stream}" if tag.stream != "main" else ""
    return f"client {tag.client}, round {tag.round}, step {tag.step}{stream}"


class EvalTally:
    """Labels, predictions and summed loss of an evaluation, accumulated batch by batch."""

    def __init__(self):
        self.ys: list[np.ndarray] = []
        self.preds: list[np.ndarray] = []
        self.loss = 0.0

    def result(self) -> tuple[np.ndarray, np.ndarray, float]:
        if not self.ys:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0
        return np.concatenate(self.ys), np.concatenate(self.preds), self.loss


@torch.no_grad()
def predict_batches(x: np.ndarray, y: np.ndarray, data_spec: DataSpec, batch_size: int,
                    logits: Callable[[torch.Tensor], torch.Tensor], tally: EvalTally, device="cpu") -> EvalTally:
    """The one evaluation loop: ``logits`` of every batch of ``x``, cross-entropy summed into ``tally``."""
    for i in range(0, len(y), batch_size):
        xb = to_tensor(x[i:i + batch_size], data_spec).to(device)
        yb = torch.tensor(np.asarray(y[i:i + batch_size]), dtype=torch.long, device=device)  # a copy: y may be read-only
        out = logits(xb)
        tally.loss += F.cross_entropy(out, yb, reduction="sum").item()
        tally.ys.append(yb.cpu().numpy())
        tally.preds.append(out.argmax(1).cpu().numpy())
    return tally


# host methods that take state over (a snapshot, a checkpoint, clients moving in): what they are given is copied first
RESTORES = frozenset({"load_state_dict", "import_clients"})


def owned(value: Any) -> Any:
    """``value`` as state a host owns: containers rebuilt, every numpy array a writable copy, every tensor a clone.
    State that reaches a host through Ray's object store is deserialized zero-copy, so its numpy arrays are read-only
    views of shared memory; in process it is the very object the caller keeps (a :class:`RoundGuard` snapshot that
    may be restored again). A host that updated either in place would fail ("output array is read-only") or change
    the snapshot under its keeper."""
    return copy.deepcopy(value)


def invoke(host: Any, method: str, *args, **kwargs) -> Any:
    """Every backend's way into a host method: ``host.method(*args, **kwargs)``, with the arguments of a restoring
    method (:data:`RESTORES`, also when it is reached through :meth:`ServerHost.serve`) made :func:`owned` first."""
    if method in RESTORES or (method == "serve" and args and args[0] in RESTORES):
        args, kwargs = owned(args), owned(kwargs)
    return getattr(host, method)(*args, **kwargs)


def limit_threads(n: int) -> None:
    """``n`` threads for torch and for the BLAS libraries under numpy and scipy (threadpoolctl). Ray sets
    OMP_NUM_THREADS only in actors, so an in-process host (the local backend) would otherwise run OpenBLAS with a
    thread per core, and OpenBLAS threads that meet busy cores spin: GAS's factor update (``stpqrt`` on a 3,136 x
    3,136 factor) took 64 s with 2 threads on the loaded 2-core machine and 0.13 s with 1."""
    torch.set_num_threads(n)
    threadpoolctl.threadpool_limits(n)


def _clone_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class _Counters:
    def __init__(self):
        self.v = defaultdict(float)

    def add(self, **kw):
        for k, x in kw.items():
            self.v[k] += x


class ClientHost:
    """Hosts a set of virtual clients on one worker; ``train_idx``'s keys are the clients it holds now."""

    # per-client mappings that move with a client to another host (``export_clients``); a subclass that keeps
    # per-client state of its own adds its attribute names (the attribute must be a dict keyed by client id)
    client_fields: tuple[str, ...] = ("train_idx", "test_idx", "profiles", "own", "opt_state", "cursor", "clock",
                                      "totals", "last_active", "job_round", "job_loss")

    def __init__(self, spec: HostSpec, worker_index: int, data: dict, train_idx: dict[int, np.ndarray],
                 test_idx: dict[int, np.ndarray], profiles: dict[int, ClientProfile], init_state: dict):
        if spec.torch_threads:
            limit_threads(spec.torch_threads)
        torch.manual_seed(spec.seed * 1009 + worker_index)
        self.spec = spec
        self.params = spec.params
        self.worker_index = worker_index
        self.x, self.y = data["x"], data["y"]
        self.train_idx = {int(c): np.asarray(v) for c, v in train_idx.items()}
        self.test_idx = {int(c): np.asarray(v) for c, v in test_idx.items()}
        self.profiles = {int(c): p for c, p in profiles.items()}
        self.global_state = transport.unpack_state(init_state)
        self.store = SpillStore(spec.client_state_bytes, spec.spill_dir)
        self.own = self.store.view("own")
        self.opt_state = self.store.view("opt")
        self.cursor: dict[int, tuple[int, int]] = {c: (0, 0) for c in self.train_idx}
        self._perm: dict[int, tuple[int, np.ndarray]] = {}
        self.clock: dict[int, float] = {c: 0.0 for c in self.train_idx}
        self.slots: dict[int, ModelSlot] = {}
        self._pool: list[torch.nn.Module] = []
        self.pending: dict[Tag, torch.Tensor] = {}
        self._replay: dict[Tag, tuple[np.ndarray, dict]] = {}
        self.flops = FlopCache()
        self.round_stats: dict[int, _Counters] = defaultdict(_Counters)
        self.totals: dict[int, _Counters] = defaultdict(_Counters)
        self.round = -1
        self.job_round: dict[int, int] = {}  # event driver: the global round each active client's job began in
        self.job_loss: dict[int, float] = {}  # event driver: mean loss of a local job, sent with the model
        self.last_active: dict[int, float] = {}  # clock at the end of the client's last round
        self.dropped: dict[int, str] = {}  # clients dropped this round (job, under events) and why (on_bad_client)
        self._dirty: set[int] = set(self.train_idx)  # clients changed since the last changed_clients()

    # ---- virtual-client bookkeeping -------------------------------------------------------------------------
    def _new_module(self) -> torch.nn.Module:
        if self._pool:
            return self._pool.pop()
        return self.build_module()

    def build_module(self) -> torch.nn.Module:
        """A fresh client model (its weights are loaded after); a host whose clients hold more than the client part
        (Ampere's auxiliary net) overrides this. Released models are pooled and reused."""
        client, _ = build_parts(self.spec)
        return client

    def activate(self, cid: int, state: dict | None = None, rnd: int | None = None) -> ModelSlot:
        """The client's slot for this round: its own model (or the global one, or ``state``), its optimizer with
        the per-client state restored and the learning rate of round ``rnd`` (default: the host's round)."""
        if cid in self.slots:
            return self.slots[cid]
        if cid not in self.train_idx:
            raise KeyError(f"client {cid} is not hosted by worker {self.worker_index}")
        module = self._new_module()
        module.load_state_dict(state if state is not None else self.own.get(cid, self.global_state))
        module.train()
        opt = make_optimizer(module.parameters(), self.spec.client_optimizer)
        if cid in self.opt_state:
            opt.load_state_dict(self.opt_state[cid])
        set_lr(opt, round_lr(self.spec.client_optimizer, self.round if rnd is None else rnd, self.spec.rounds))
        self.slots[cid] = ModelSlot(module, opt)
        return self.slots[cid]

    def release(self, cid: int, keep_weights: bool | None = None) -> None:
        slot = self.slots.pop(cid, None)
        if slot is None:
            return
        self._dirty.add(cid)
        if cid not in self.dropped:  # a dropped client keeps its model and optimizer state from before the round
            if keep_weights if keep_weights is not None else self.spec.persist_client_models:
                self.own[cid] = _clone_state(slot.module)
            st = slot.optimizer.state_dict()
            if st["state"]:
                self.opt_state[cid] = copy.deepcopy(st)
        self._pool.append(slot.module)

    def draw(self, cid: int, batch_size: int | None = None) -> np.ndarray:
        """Indices of the client's next batch; advances its cursor (:func:`advance_cursor`)."""
        idx_all = self.train_idx[cid]
        epoch, start, stop = advance_cursor(len(idx_all), batch_size or self.spec.batch_size, self.cursor[cid])
        cached = self._perm.get(cid)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.spec.seed, cid, epoch])
            cached = (epoch, rng.permutation(idx_all))
            self._perm[cid] = cached
        self.cursor[cid] = (epoch, stop)
        self._dirty.add(cid)
        return cached[1][start:stop]

    def batch(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x = to_tensor(self.x[idx], self.spec.data_spec)
        y = torch.as_tensor(np.asarray(self.y[idx]), dtype=torch.long)
        return x, y

    def next_batch(self, cid: int, batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch(self.draw(cid, batch_size))

    @contextlib.contextmanager
    def seeded(self, cid: int, *salt: int):
        """Client computations draw from a generator seeded per (client, salt), so their randomness (dropout,
        augmentation) does not depend on which worker hosts the client or what ran before on it."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(np.random.default_rng([self.spec.seed, 0xC11, cid, *salt]).integers(2**62)))
            yield

    def begin_round(self, rnd: int, cids: list[int], t0: float) -> None:
        self.round = rnd
        self.round_stats.clear()
        self.dropped.clear()
        for c in cids:
            if c in self.clock:
                self.clock[c] = t0
                self._dirty.add(int(c))

    # ---- the cost meter: a client's simulated clock, charged by what it computes and sends ---------------------
    def now(self, cid: int) -> float:
        """Client ``cid``'s simulated clock."""
        return self.clock.get(cid, 0.0)

    def wait_until(self, cid: int, t: float) -> float:
        """Client ``cid`` cannot go on before ``t`` (e.g. the moment a message it waits for was sent)."""
        self._dirty.add(cid)
        self.clock[cid] = max(self.clock[cid], t)
        return self.clock[cid]

    def set_clock(self, cid: int, t: float) -> float:
        """Replace client ``cid``'s clock by a timing model's result (PiPar's pipelined step takes less than the sum
        of the charges made during it)."""
        self._dirty.add(cid)
        self.clock[cid] = t
        return t

    def clip_grads(self, module: torch.nn.Module) -> None:
        if self.spec.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.spec.clip_grad_norm)

    def charge_compute(self, cid: int, flops: float) -> None:
        self._dirty.add(cid)
        self.clock[cid] += flops / self.profiles[cid].flops
        self.round_stats[cid].add(flops=flops)

    def charge_upload(self, cid: int, nbytes: int, kind: str) -> float:
        """Client ``cid`` sends ``nbytes`` of ``kind`` (activations, model, labels): counted in total and by kind."""
        self._dirty.add(cid)
        self.clock[cid] += nbytes / self.profiles[cid].up
        self.round_stats[cid].add(bytes_up=nbytes, **{f"bytes_up_{kind}": nbytes})
        return self.clock[cid]

    def charge_download(self, cid: int, nbytes: int, t_sent: float, kind: str) -> float:
        """A message of ``nbytes`` of ``kind`` (gradients, model) sent at ``t_sent`` reaches client ``cid`` (which
        may still be busy); with ``charge_server`` off (GAS's code) the transfer takes no time."""
        cost = nbytes / self.profiles[cid].down if self.spec.charge_server else 0.0
        self._dirty.add(cid)
        self.clock[cid] = max(self.clock[cid], t_sent) + cost
        self.round_stats[cid].add(bytes_down=nbytes, **{f"bytes_down_{kind}": nbytes})
        return self.clock[cid]

    # ---- split-learning steps -------------------------------------------------------------------------------
    def forward(self, tag: Tag, batch_size: int | None = None) -> Activation:
        """Client ``tag.client`` forwards its next batch; the graph stays here until the gradient for ``tag``
        (whatever its stream) arrives."""
        cid = tag.client
        slot = self.activate(cid)
        idx = self.batch_indices(tag, batch_size)
        if self.spec.asynchronous:  # what a checkpoint needs to rebuild this forward's graph (load_state_dict)
            self._replay[tag] = (idx, {k: b.detach().clone() for k, b in slot.module.named_buffers()})
        with self.seeded(cid, 0, tag.round, tag.step, zlib.crc32(tag.stream.encode())):
            x, y = self.inputs(tag, idx)
            encode = self.encoder(tag, slot)
            out, fl = self.flops.run(("fwd", tuple(x.shape)), lambda: encode(x))
        self.pending[tag] = out
        self.charge_compute(cid, fl)
        msg = Activation(tag, transport.pack(out), y, 0.0, float(len(self.train_idx[cid])))
        msg.t_sent = self.charge_upload(cid, msg.nbytes, "activations")
        return msg

    # hooks of forward (a semi-supervised host draws one batch for two streams, augments, has a teacher encoder)
    def batch_indices(self, tag: Tag, batch_size: int | None) -> np.ndarray:
        """The samples of this forward: the client's next batch."""
        return self.draw(tag.client, batch_size)

    def inputs(self, tag: Tag, idx: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Model input and the labels sent with the activation."""
        x, y = self.batch(idx)
        return x, y.numpy()

    def encoder(self, tag: Tag, slot: ModelSlot) -> Callable[[torch.Tensor], torch.Tensor]:
        """The module that encodes this forward: the client's model."""
        return slot.module

    def forward_many(self, tags: list[Tag], batch_size: int | None = None) -> list[Activation]:
        """Several forwards in one call, in order (one per stream of a client step)."""
        return [self.forward(tag, batch_size) for tag in tags]

    def backward(self, grad: Gradient) -> float:
        """Apply the gradient for the activation with the same tag; returns the client's clock."""
        tag = grad.tag
        if grad.rejected and tag not in self.pending:  # withheld for a tag that was not ours (a forged round)
            self.drop(tag.client, grad.rejected)
            return self.clock.get(tag.client, 0.0)
        try:
            out = self.pending.pop(tag)
        except KeyError:
            raise KeyError(f"gradient for {tag} has no pending activation on worker {self.worker_index}; "
                           f"pending: {sorted(self.pending)[:5]}") from None
        self._replay.pop(tag, None)
        cid = tag.client
        slot = self.slots[cid]
        self.charge_download(cid, grad.nbytes, grad.t_sent, "gradients")
        self.round_stats[cid].add(steps=1)
        why = grad.rejected
        if not why and grad.g is not None:
            why = gradient_fault(grad.g, out, screens_nonfinite(self.spec))
        if why and not grad.rejected:
            if self.spec.on_bad_client == "fail":
                raise _bad_input(where_of(tag), f"rejected by the client: {why}")
            # the backward pass is charged as if it had run (the event loop predicts the client's clock so)
            self.charge_compute(cid, self.backward_pass(tag, out, torch.zeros_like(out)))
        if why:
            self.drop(cid, why)
        if grad.g is None or cid in self.dropped:
            return self.clock[cid]
        g = transport.unpack(grad.g)
        slot.optimizer.zero_grad(set_to_none=True)
        fl = self.backward_pass(tag, out, g)
        self.before_step(cid, slot)
        slot.optimizer.step()
        self.charge_compute(cid, fl)
        return self.clock[cid]

    def drop(self, cid: int, why: str) -> None:
        """Client ``cid`` takes no further part in this round (job): no more updates, left out of aggregation, its
        own model and optimizer state stay as they were before the round (``runtime.on_bad_client: drop``)."""
        if cid not in self.dropped:
            self.dropped[cid] = why
            self.round_stats[cid].add(dropped=1)

    # hooks of the client's update (SplitGP adds a local loss, SCAFFOLD corrects the gradients)
    def backward_pass(self, tag: Tag, out: torch.Tensor, g: torch.Tensor) -> int:
        """Back-propagate the server's gradient ``g`` of the activation ``out``; returns the FLOPs."""
        return self.flops.run(("bwd", tuple(out.shape)), lambda: out.backward(g))[1]

    def before_step(self, cid: int, slot: ModelSlot) -> None:
        """Last touch on the gradients before the optimizer steps: clipping (``train.clip_grad_norm``)."""
        self.clip_grads(slot.module)

    def local_train(self, cid: int, steps: int) -> float:
        """Plain local SGD of the hosted part on the client's data (FedAvg); returns the mean loss."""
        slot = self.activate(cid)
        losses = []
        with self.seeded(cid, 1, self.round):
            for _ in range(steps):
                losses.append(self._local_step(cid, slot))
        return float(np.mean(losses))

    def _local_step(self, cid: int, slot: ModelSlot) -> float:
        x, y = self.next_batch(cid)

        def fwd_bwd():
            slot.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(slot.module(x), y)
            loss.backward()
            return loss

        loss, fl = self.flops.run(("train", tuple(x.shape)), fwd_bwd)
        check_finite(loss.item(), self.spec.stop_on_nonfinite, f"round {self.round}, client {cid}")
        self.before_step(cid, slot)
        slot.optimizer.step()
        self.charge_compute(cid, fl)
        self.round_stats[cid].add(steps=1, loss_sum=loss.item(), loss_n=1)
        return loss.item()

    # ---- model movement ------------------------------------------------------------------------------------
    def _state_of(self, cid: int) -> dict:
        if cid in self.slots:
            return self.slots[cid].module.state_dict()
        return self.own.get(cid, self.global_state)

    def partial_sum(self, weights: dict[int, float]) -> StateMsg | None:
        """Weighted sum of the hosted clients' current weights (upload counted per client)."""
        mine = [(int(c), w) for c, w in weights.items() if int(c) in self.train_idx and int(c) not in self.dropped]
        if not mine:
            return None
        states = [self._state_of(c) for c, _ in mine]
        t = max(self.charge_upload(c, transport.state_nbytes(st), "model") for (c, _), st in zip(mine, states))
        acc = weighted_sum(states, [w for _, w in mine])
        return StateMsg(transport.pack_state(acc), t_sent=t, weight=float(sum(w for _, w in mine)))

    def set_global(self, msg: StateMsg, receivers: list[int] | None = None, only: list[int] | None = None) -> None:
        """Install an aggregate: for all clients (``only`` None) or as the own model of the clients in ``only``.
        Download bytes and time are charged to ``receivers`` (the round's clients) that this host holds."""
        state = transport.unpack_state(msg.state)
        nb = transport.state_nbytes(state)
        if only is None:
            self.global_state = state
            if not self.spec.persist_client_models:
                self._dirty.update(self.own)
                self.own.clear()
        else:
            for c in only:
                if int(c) in self.train_idx:
                    self.own[int(c)] = state
                    self._dirty.add(int(c))
        for c in receivers or []:
            c = int(c)
            if c in self.train_idx:
                if c in self.slots:
                    self.slots[c].module.load_state_dict(state)
                self.charge_download(c, nb, msg.t_sent, "model")

    def get_state(self, cid: int) -> StateMsg:
        """Client ``cid`` sends its current model (upload charged)."""
        st = self._state_of(cid)
        t = self.charge_upload(cid, transport.state_nbytes(st), "model")
        return StateMsg(transport.pack_state(st), t_sent=t, weight=float(len(self.train_idx[cid])))

    def load_state(self, cid: int, msg: StateMsg) -> None:
        """Receive a model (hand-over in sequential split learning) as this client's own."""
        state = transport.unpack_state(msg.state)
        self.own[cid] = state
        self._dirty.add(cid)
        if cid in self.slots:
            self.slots[cid].module.load_state_dict(state)
        self.charge_download(cid, transport.state_nbytes(state), msg.t_sent, "model")

    # ---- asynchronous jobs (the event driver) ---------------------------------------------------------------------
    def join(self, cid: int, msg: StateMsg, t0: float, rnd: int) -> float:
        """Client ``cid`` takes a free slot at simulated time ``t0`` and starts from the global model ``msg``
        (download charged); ``rnd`` is the global round (learning rate, randomness). Returns its clock."""
        if cid in self.slots:
            raise RuntimeError(f"client {cid} joins while its previous job is still active on worker "
                               f"{self.worker_index}")
        state = transport.unpack_state(msg.state)
        self.clock[cid] = t0
        self.job_round[cid] = rnd
        self._dirty.add(cid)
        self.dropped.pop(cid, None)
        self.activate(cid, state=state, rnd=rnd)
        return self.charge_download(cid, transport.state_nbytes(state), msg.t_sent, "model")

    def local_job(self, cid: int, steps: int) -> float:
        """``steps`` local SGD batches of the client's whole part (asynchronous FL); returns the mean loss."""
        slot = self.slots[cid]
        with self.seeded(cid, 1, self.job_round.get(cid, 0)):
            self.job_loss[cid] = float(np.mean([self._local_step(cid, slot) for _ in range(steps)]))
        return self.job_loss[cid]

    def leave(self, cid: int) -> StateMsg:
        """The client uploads its model (upload charged) and frees its slot."""
        msg = self.get_state(cid)
        msg.state = {k: np.array(v, copy=True) for k, v in msg.state.items()}  # the slot's module is reused
        msg.loss = self.job_loss.pop(cid, float("nan"))
        msg.rejected = self.dropped.get(cid, "")
        self.release(cid, keep_weights=False)
        return msg

    def end_round(self) -> dict[int, dict]:
        for tag in [t for t in self.pending if t.client in self.dropped]:  # never answered: its tag was forged
            del self.pending[tag]
        if self.pending:
            raise RuntimeError(f"worker {self.worker_index}: round {self.round} ended with activations that never "
                               f"got a gradient: {sorted(self.pending)[:5]}")
        for c in list(self.slots):
            self.release(c)
        out = {}
        self._dirty.update(self.round_stats)
        for c, cnt in self.round_stats.items():
            out[c] = dict(cnt.v, t_end=self.clock[c])
            self.totals[c].add(**cnt.v, rounds=1)
            self.last_active[c] = self.clock[c]
            if c in self.dropped:
                out[c]["drop_reason"] = self.dropped[c]
        return out

    # ---- evaluation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate_clients(self, cids: list[int], server_state: StateMsg) -> tuple[np.ndarray, np.ndarray, float]:
        """Each client's own test split through its own client model and the given server model."""
        client, server = build_parts(self.spec)
        server.load_state_dict(transport.unpack_state(server_state.state))
        client.eval(), server.eval()
        tally = EvalTally()
        for c in cids:
            c = int(c)
            if c not in self.test_idx or len(self.test_idx[c]) == 0:
                continue
            client.load_state_dict(self._state_of(c))
            idx = self.test_idx[c]
            predict_batches(self.x[idx], self.y[idx], self.spec.data_spec, self.spec.eval_batch_size,
                            lambda x: server(client(x)), tally)
        return tally.result()

    # ---- clients moving between hosts ---------------------------------------------------------------------------
    def _fields_of(self, cid: int, take: bool) -> dict:
        """Client ``cid``'s entry of every ``client_fields`` mapping that has one (removed from here if ``take``)."""
        out = {}
        for name in self.client_fields:
            book = getattr(self, name)
            if cid in book:
                value = book.pop(cid) if take else book.peek(cid) if isinstance(book, StoreView) else book[cid]
                out[name] = dict(value.v) if isinstance(value, _Counters) else value
        if take:
            self._perm.pop(cid, None)
            self._dirty.discard(cid)
        return out

    def export_clients(self, cids: list[int]) -> dict[int, dict]:
        """Hand clients ``cids`` over to another host (the runtime placed them there): their state leaves this
        host. Only between rounds: a client with a slot (trained now) cannot move."""
        busy = [int(c) for c in cids if int(c) in self.slots]
        if busy:
            raise RuntimeError(f"worker {self.worker_index}: clients {busy[:5]} are being trained; they cannot move")
        return {int(c): self._fields_of(int(c), take=True) for c in cids if int(c) in self.train_idx}

    def import_clients(self, *bundles: dict[int, dict]) -> None:
        """Take clients over from other hosts (``export_clients``' results)."""
        for bundle in bundles:
            for c, fields in bundle.items():
                for name, value in fields.items():
                    if name == "totals":
                        self.totals[c] = _Counters()
                        self.totals[c].add(**value)
                    else:
                        getattr(self, name)[c] = value
                self._dirty.add(int(c))

    def changed_clients(self) -> list[int]:
        """Clients whose state may have changed since the last call (they took part in a round or job, received a
        model, or arrived here); the incremental snapshots of ``RoundGuard`` copy only these."""
        out, self._dirty = sorted(self._dirty), set()
        return out

    # ---- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self, clients: list[int] | None = None) -> dict:
        """Everything that persists across rounds: the host's own state and every held client's (``clients``: of
        those only, for an incremental snapshot; ``held`` always lists them all). Synchronous rounds end with no
        slot; under the event driver, active clients' slots (weights, optimizer) and their forwards awaiting a
        gradient are kept as what it takes to redo them (batch indices, the module's buffers before the
        forward)."""
        if self.pending and set(self.pending) != set(self._replay):
            raise RuntimeError(f"worker {self.worker_index}: checkpoint with activations awaiting a gradient "
                               f"({sorted(self.pending)[:5]}) outside the event driver")
        slots = {c: (_clone_state(sl.module), copy.deepcopy(sl.optimizer.state_dict())) for c, sl in self.slots.items()}
        held = sorted(self.train_idx)
        which = held if clients is None else [int(c) for c in clients if int(c) in self.train_idx]
        return {"global": self.global_state, "held": held,
                "clients": {c: self._fields_of(c, take=False) for c in which},
                "torch_rng": torch.get_rng_state(), "slots": slots, "replay": dict(self._replay),
                "dropped": dict(self.dropped)}

    def load_state_dict(self, st: dict) -> None:
        """Restore :meth:`state_dict`'s result (with every held client's state)."""
        if set(st["clients"]) != set(st["held"]):
            raise ValueError(f"worker {self.worker_index}: state of clients {sorted(st['clients'])[:5]}... does "
                             f"not match the held clients {st['held'][:5]}...")
        self.global_state = st["global"]
        for name in self.client_fields:
            getattr(self, name).clear()
        self._perm.clear()
        self.import_clients(st["clients"])
        self.dropped = dict(st.get("dropped", {}))
        for c, (weights, opt) in st.get("slots", {}).items():
            module = self._new_module()
            module.load_state_dict(weights)
            module.train()
            optimizer = make_optimizer(module.parameters(), self.spec.client_optimizer)
            optimizer.load_state_dict(opt)
            self.slots[c] = ModelSlot(module, optimizer)
        for tag, (idx, buffers) in sorted(st.get("replay", {}).items()):  # rebuild the graphs, charging nothing
            module = self.slots[tag.client].module
            after = {k: b.detach().clone() for k, b in module.named_buffers()}
            module.load_state_dict(buffers, strict=False)
            x, _ = self.batch(idx)
            with self.seeded(tag.client, 0, tag.round, tag.step, zlib.crc32(tag.stream.encode())):
                self.pending[tag] = module(x)
            module.load_state_dict(after, strict=False)
            self._replay[tag] = (idx, buffers)
        torch.set_rng_state(st["torch_rng"])
        self._dirty = set()

    def client_totals(self) -> dict[int, dict]:
        """Per hosted client: counters summed over the rounds, and ``t_last``, its clock at the end of the last
        round it took part in (its participation time: every client starts at 0)."""
        return {c: dict(v.v, t_last=self.last_active.get(c, 0.0)) for c, v in self.totals.items()}


class ServerHost:
    """Owns the server-side model(s) and optimizer(s). ``models['main']`` is the server model; per-client copies
    (PSL, SFLV1) are forked from it and merged back by weighted averaging."""

    def __init__(self, spec: HostSpec, init_state: dict, client_init_state: dict, test: dict,
                 labeled: dict | None = None):
        if spec.torch_threads:
            limit_threads(spec.torch_threads)
        torch.manual_seed(spec.seed * 1009 + 7919)
        self.spec = spec
        self.params = spec.params
        want = spec.device
        self.device = torch.device("cuda" if want in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
        client, server = build_parts(spec)
        server.load_state_dict(transport.unpack_state(init_state))
        server.to(self.device).train()
        self.models: dict = {"main": ModelSlot(server, make_optimizer(server.parameters(), spec.server_optimizer))}
        self.eval_client = client.to(self.device)
        self.test_x, self.test_y = test["x"], test["y"]
        self.labeled = labeled or {}  # the server's own labelled set (data.n_labeled; semi-supervised methods)
        self.flops = FlopCache()
        self.clock = 0.0
        self.round = -1
        self.dropped: dict[int, str] = {}  # clients whose activations are withheld this round (on_bad_client: drop)
        self._act_form: tuple | None = None  # (per-sample shape, dtype) of a valid activation
        self._varargs: dict[str, bool] = {}
        self._unbatched: str | None = None  # why vmap refused the server model (batched_copies falls back)
        self.reset_round()

    def reset_round(self):
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.round_flops = 0.0
        self.nonfinite: Tag | None = None
        self.busy_wall = 0.0
        self.drops: dict[int, str] = {}  # this round's dropped clients: "client c, round r, step s: why"
        if not self.spec.asynchronous:  # under events a client stays dropped until its job ends
            self.dropped.clear()

    def begin_round(self, rnd: int, t0: float) -> None:
        self.round = rnd
        self.clock = max(self.clock, t0)
        self.reset_round()
        for slot in self.models.values():
            set_lr(slot.optimizer, round_lr(self.spec.server_optimizer, rnd, self.spec.rounds))

    def charge(self, flops: float, ready_at: float = 0.0) -> float:
        """Advance the server clock by a computation that can start once ``ready_at`` has passed (instantly with
        ``charge_server`` off, as in GAS's code)."""
        cost = flops / self.spec.server_flops if self.spec.charge_server else 0.0
        self.clock = max(self.clock, ready_at) + cost
        self.round_flops += flops
        return self.clock

    # ---- what arrives from clients -------------------------------------------------------------------------------
    def serve(self, method: str, *args, **kwargs):
        """Every runtime call of a server method enters here (``Runtime.server``, the step loops, the event loop):
        the activations among its arguments are screened (:meth:`screen`) before ``method`` sees them. With
        ``runtime.on_bad_client: drop`` a rejected activation is answered with an empty gradient marked
        ``rejected`` and the method gets the others; every activation of a rejected client is withheld (its
        streams are paired). ``method`` returns one gradient per activation: a list when it takes ``*acts``."""
        fn = getattr(self, method)
        pos = [i for i, a in enumerate(args) if isinstance(a, Activation)]
        bad = {}
        for i in pos:
            why = self.screen(args[i])
            if why:
                bad[args[i].tag.client] = why
        if not bad:
            return fn(*args, **kwargs)
        keep = [a for a in args if not (isinstance(a, Activation) and a.tag.client in bad)]
        served = iter(fn(*keep, **kwargs) if len(keep) > len(args) - len(pos) else [])
        grads = [Gradient(args[i].tag, None, self.clock, rejected=bad[args[i].tag.client])
                 if args[i].tag.client in bad else next(served) for i in pos]
        if method not in self._varargs:
            self._varargs[method] = any(q.kind == q.VAR_POSITIONAL for q in inspect.signature(fn).parameters.values())
        return grads if self._varargs[method] else grads[0]

    def screen(self, act: Activation) -> str:
        """'' if ``act`` may be used; otherwise why not (:func:`activation_fault`). Under ``on_bad_client: fail``
        a fault raises :class:`BadClientInput` naming client, round and step; under ``drop`` the client is
        dropped for the round (for its job, under events) and its later activations are withheld too."""
        c = act.tag.client
        if c in self.dropped:
            return self.dropped[c]
        shape, dtype = self.activation_form()
        why = activation_fault(act, shape, dtype, self.spec.num_classes, self.expected_round(act.tag),
                               screens_nonfinite(self.spec))
        if not why:
            return ""
        if self.spec.on_bad_client == "fail":
            raise _bad_input(where_of(act.tag), f"activation rejected by the server: {why}")
        self.dropped[c] = why
        self.drops[c] = f"{where_of(act.tag)}: {why}"
        return why

    def expected_round(self, tag: Tag) -> int | None:
        """The round an arriving activation must carry."""
        return self.round

    def activation_form(self) -> tuple[tuple, np.dtype]:
        """Per-sample shape and dtype of what the client part sends (probed once on zeros)."""
        if self._act_form is None:
            enc = self.client_encoder()
            mode = enc.training
            enc.eval()
            with torch.no_grad():
                out = transport.pack(enc(torch.zeros((2, *self.spec.input_shape), device=self.device)))
            enc.train(mode)
            self._act_form = (tuple(out.shape[1:]), out.dtype)
        return self._act_form

    def client_encoder(self) -> torch.nn.Module:
        """The module whose output a client sends (the client part)."""
        return self.eval_client

    # ---- the one training step ---------------------------------------------------------------------------------
    def step_through(self, x: torch.Tensor, y: torch.Tensor, module, optimizers: list, *, tag: Tag, flop_key: tuple,
                     ready_at: float = 0.0, loss_fn: Callable | None = None, record: bool = True,
                     varying_batch: bool = False, where: str | None = None) -> float:
        """Forward ``x`` through ``module``, ``loss_fn(logits, y)`` (default: mean cross-entropy), backward, then
        step ``optimizers`` (none: a gradient pass, e.g. through a frozen server); the FLOPs (counted once per
        ``flop_key``) are charged to the server clock from ``ready_at`` on and the wall time to ``busy_wall``.
        ``record``: the loss counts as a training loss (checked for finiteness, logged). Returns the loss; the
        caller reads ``x.grad`` when it needs the gradient for the client. ``varying_batch``: FLOPs counted once
        per sample for a computation whose batch size changes every call (``FlopCache.run``). ``where``: how a
        non-finite loss names the step (default: round, client and step of ``tag``)."""
        t_wall = time.perf_counter()
        loss_fn = loss_fn or F.cross_entropy

        def step():
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss = loss_fn(module(x), y)
            loss.backward()
            return loss

        loss, fl = self.flops.run(flop_key, step, batch=len(y) if varying_batch else None)
        lv = self.settle_step(float(loss.item()), fl, module, optimizers, tag=tag, ready_at=ready_at, record=record,
                              where=where)
        self.busy_wall += time.perf_counter() - t_wall
        return lv

    def settle_step(self, lv: float, flops: int, module, optimizers: list, *, tag: Tag, ready_at: float = 0.0,
                    record: bool = True, where: str | None = None) -> float:
        """The rest of a training step once its gradients are in ``module``'s parameters: the finite check,
        clipping (``train.clip_grad_norm``), the optimizer steps, ``flops`` on the server clock, the loss logged."""
        if record:
            self._check(lv, tag, where)
        if optimizers and self.spec.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.spec.clip_grad_norm)
        for opt in optimizers:
            opt.step()
        self.charge(flops, ready_at)
        if record:
            self.losses.append(lv)
        return lv

    def step_activation(self, act: Activation, module, optimizers: list, flop_key="main") -> Gradient:
        """One SGD step of ``module`` (and its ``optimizers``) on an activation; returns the client's gradient."""
        x = transport.unpack(act.x, self.device, writable=True).requires_grad_(True)
        y = torch.tensor(act.y, device=self.device)
        lv = self.step_through(x, y, module, optimizers, tag=act.tag, flop_key=("train", flop_key, tuple(x.shape)),
                               ready_at=act.t_sent)
        return self.answer(act, x.grad, lv)

    def answer(self, act: Activation | Tag, g: torch.Tensor | None, lv: float) -> Gradient:
        """The client's gradient for ``act`` (an activation or its tag), sent at the server's clock, its norm
        logged; ``g`` None: nothing goes back for this activation (e.g. a teacher stream)."""
        tag = act.tag if isinstance(act, Activation) else act
        if g is None:
            return Gradient(tag, None, self.clock, lv)
        self.grad_norms.append(float(g.norm()))
        return Gradient(tag, transport.pack(g), self.clock, lv)

    def revise(self, grads: list[Gradient], values: list) -> list[Gradient]:
        """A rule applied on top of the gradients just answered (SGLR's sharing): the first ``len(values)`` of
        ``grads`` carry ``values`` instead (same tags, times and losses), the rest are kept; the logged gradient
        norms follow."""
        new = [Gradient(g.tag, v.detach().cpu().contiguous().numpy() if isinstance(v, torch.Tensor) else v,
                        g.t_sent, g.loss) for g, v in zip(grads, values)]
        out = new + list(grads[len(values):])
        self.grad_norms[-len(grads):] = [float(np.linalg.norm(g.g)) for g in out]
        return out

    def receive(self, acts: list[Activation] | tuple, writable: bool = True, stamp: bool = True
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The activations' features and labels as tensors on the server's device (``writable``: owned copies a
        step may change); ``stamp``: the server waits for the last of them to arrive (its clock)."""
        feats = [transport.unpack(a.x, self.device, writable=writable) for a in acts]
        ys = [torch.as_tensor(np.array(a.y), device=self.device) for a in acts]
        if stamp:
            self.wait_until(max(a.t_sent for a in acts))
        return feats, ys

    def now(self) -> float:
        """The server's simulated clock."""
        return self.clock

    def wait_until(self, t: float) -> float:
        """The server cannot go on before ``t``."""
        self.clock = max(self.clock, t)
        return self.clock

    def state_message(self, state: dict[str, torch.Tensor], **kw) -> StateMsg:
        """``state`` as a message sent now (at the server's clock)."""
        return StateMsg.packed(state, t_sent=self.clock, **kw)

    def train_step(self, act: Activation, key="main") -> Gradient:
        """Forward the activation through ``models[key]``, step it, return dL/d(activation) to the client."""
        slot = self.models[key]
        return self.step_activation(act, slot.module, [slot.optimizer], "main" if key == "main" else "copy")

    def train_copies(self, *acts: Activation) -> list[Gradient]:
        """One step of each activation's client's copy (``models[client]``, forked by ``fork``); one gradient per
        activation, as ``train_step`` on each in the given order gives: same gradients, losses, gradient norms,
        finite checks and clock (each copy's FLOPs charged in that order from its activation's arrival on).

        With ``runtime.batched_copies`` the copies whose activations have equal shapes run their forward and
        backward as one batched computation (:func:`batched.copies_backward`), and each copy's own optimizer steps
        on its own gradients (:meth:`settle_step`). A shape only one client sent (a short last batch) takes the
        per-copy path, and so does everything once vmap has refused the model (dropout in training mode, ...), or
        a copy that more than one activation of the call steps (its steps depend on each other)."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        if self.spec.batched_copies and self._unbatched is None:
            uses = Counter(a.tag.client for a in acts)
            for i, a in enumerate(acts):
                if uses[a.tag.client] == 1:
                    groups[(a.x.shape, a.x.dtype.str, np.shape(a.y))].append(i)
        done: dict[int, tuple] = {}
        for idx in (g for g in groups.values() if len(g) > 1):
            steps = self._batched_copies([acts[i] for i in idx])
            if steps is None:
                break
            done.update(zip(idx, steps))
        out = []
        for i, a in enumerate(acts):
            if i not in done:
                out.append(self.train_step(a, key=a.tag.client))
                continue
            t_wall = time.perf_counter()
            lv, g, fl = done[i]
            slot = self.models[a.tag.client]
            self.settle_step(lv, fl, slot.module, [slot.optimizer], tag=a.tag, ready_at=a.t_sent)
            out.append(self.answer(a, g, lv))
            self.busy_wall += time.perf_counter() - t_wall
        return out

    def _batched_copies(self, acts: list[Activation]) -> list[tuple[float, torch.Tensor, int]] | None:
        """Forward and backward of the copies of ``acts`` (equal shapes) in one computation: per activation its
        loss, its gradient and the FLOPs its own step is charged (counted once per shape on a throwaway copy, as
        ``train_step`` counts them). None when vmap refuses the model: remembered, warned once."""
        t_wall = time.perf_counter()
        modules = [self.models[a.tag.client].module for a in acts]
        x = torch.from_numpy(np.stack([a.x for a in acts])).to(self.device)
        y = torch.from_numpy(np.stack([np.asarray(a.y) for a in acts])).to(self.device)
        try:
            losses, gx = batched.copies_backward(modules, x, y)
        except RuntimeError as e:
            self._unbatched = f"{type(e).__name__}: {e}"
            warnings.warn(f"runtime.batched_copies: the server model cannot be batched ({self._unbatched}); its "
                          f"copies step one after another")
            return None

        def per_copy():
            xi = x[0].detach().clone().requires_grad_(True)
            F.cross_entropy(copy.deepcopy(modules[0])(xi), y[0]).backward()

        fl = self.flops.count(("train", "copy", tuple(x.shape[1:])), per_copy)
        self.busy_wall += time.perf_counter() - t_wall
        return [(float(lv), g, fl) for lv, g in zip(losses.tolist(), gx)]

    def _check(self, loss: float, tag: Tag, where: str | None = None) -> None:
        if not math.isfinite(loss) and self.nonfinite is None:
            self.nonfinite = tag
        where = where or (f"round {tag.round}, client {tag.client} (step {tag.step})" if tag.client >= 0 else
                          f"round {tag.round}, server update {tag.step}")  # a server-only step (Tag client -1)
        check_finite(loss, self.spec.stop_on_nonfinite, where)

    # ---- per-client copies ------------------------------------------------------------------------------------
    def fork(self, keys: list) -> None:
        """A copy of the main model and its optimizer per key, each with its own optimizer state (a copy:
        ``load_state_dict`` keeps the tensors it is given, which the copies would then update in place in turn)."""
        main = self.models["main"]
        for k in keys:
            module = copy.deepcopy(main.module)
            opt = make_optimizer(module.parameters(), self.spec.server_optimizer)
            opt.load_state_dict(copy.deepcopy(main.optimizer.state_dict()))  # carries the round's lr too
            self.models[k] = ModelSlot(module, opt)

    def merge(self, weights: dict) -> None:
        """Replace the main server model by the weighted average of the copies (which are dropped). The copies'
        optimizer states (momentum, Adam moments) are averaged with the same weights, so one copy merges back
        exactly (SFLV1 with one client equals SFLV2)."""
        keys = list(weights)
        w = [weights[k] for k in keys]
        avg = average_states([self.models[k].module.state_dict() for k in keys], w)
        self.models["main"].module.load_state_dict(avg)
        merged = average_optimizer_states([self.models[k].optimizer.state_dict() for k in keys], w)
        if merged is not None:
            self.models["main"].optimizer.load_state_dict(merged)
        for k in keys:
            del self.models[k]

    # ---- client-model aggregation --------------------------------------------------------------------------
    def aggregate(self, *partials: StateMsg | None) -> StateMsg:
        """FedAvg: the workers' partial sums (``ClientHost.partial_sum``) summed and divided by the total weight."""
        parts = [p for p in partials if p is not None]
        if not parts:
            raise BadClientInput(f"round {self.round}: every client of the round was dropped "
                                 f"(runtime.on_bad_client: drop), nothing to aggregate: {self.drops}")
        total = sum(p.weight for p in parts)
        state = finish_average([p.state for p in parts], total, self.eval_client.state_dict())
        return StateMsg(transport.pack_state(state), t_sent=max(p.t_sent for p in parts), weight=total)

    def get_state(self, key="main") -> StateMsg:
        return StateMsg(transport.pack_state(self.models[key].module.state_dict()), t_sent=self.clock)

    # ---- evaluation ------------------------------------------------------------------------------------------
    def predict(self, logits: Callable[[torch.Tensor], torch.Tensor]) -> tuple[np.ndarray, np.ndarray, float]:
        """The global test set through ``logits`` (the one evaluation loop, :func:`predict_batches`)."""
        tally = predict_batches(self.test_x, self.test_y, self.spec.data_spec, self.spec.eval_batch_size, logits,
                                EvalTally(), self.device)
        y, pred, loss = tally.result()
        return np.asarray(self.test_y), pred, loss

    @torch.no_grad()
    def evaluate(self, client_state: StateMsg, key="main") -> tuple[np.ndarray, np.ndarray, float]:
        """The given client model and ``models[key]`` on the global test set."""
        client, server = self.eval_client, self.models[key].module
        client.load_state_dict(transport.unpack_state(client_state.state))
        client.eval(), server.eval()
        out = self.predict(lambda x: server(client(x)))
        server.train()
        return out

    def end_round(self) -> dict:
        if self.nonfinite is not None and self.spec.stop_on_nonfinite:
            t = self.nonfinite
            raise NonFiniteLossError(f"non-finite loss at round {t.round}, client {t.client} (step {t.step})")
        return {"losses": self.losses, "grad_norms": self.grad_norms, "flops": self.round_flops,
                "t_end": self.clock, "busy_wall": self.busy_wall, "metrics": self.round_metrics(),
                "dropped": dict(self.drops)}

    def round_metrics(self) -> dict:
        """Method-specific numbers of the round, logged as they are (e.g. GAS's generated activations)."""
        return {}

    # ---- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"models": {k: (s.module.state_dict(), s.optimizer.state_dict()) for k, s in self.models.items()},
                "clock": self.clock, "torch_rng": torch.get_rng_state(), "dropped": dict(self.dropped)}

    def load_state_dict(self, st: dict) -> None:
        for k, (ms, os_) in st["models"].items():
            if k not in self.models:
                self.fork([k])
            self.models[k].module.load_state_dict(ms)
            self.models[k].optimizer.load_state_dict(os_)
        self.clock = st["clock"]
        self.dropped = dict(st.get("dropped", {}))
        torch.set_rng_state(st["torch_rng"])
