"""What runs inside the actors: a client host (many virtual clients) and a server host. No Ray here.

The Ray backend wraps these classes in actors; the local backend calls them in-process. Algorithms that need other
server or client behaviour subclass them (``Algorithm.server_host`` / ``client_host``) and add methods, which the
runtime reaches through ``Runtime.server(method, ...)`` / ``Runtime.client(cid, method, ...)``.

Client host state, per virtual client it hosts: its own model weights when the algorithm keeps un-aggregated client
models (``persist``), its optimizer state (persists across rounds, as in CycleSL's code), its data cursor (epoch and
position in a permutation drawn from (seed, client, epoch)), its simulated clock and its byte/FLOP counters. A client
being trained in the current round holds a module instance of its own (a *slot*), so a forward's autograd graph stays
alive in the host until the gradient with the same tag arrives; slots are released at the end of the round.
"""

from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from raysplit.clock import ClientProfile, FlopCache
from raysplit.data import DataSpec, to_tensor
from raysplit.runtime import transport
from raysplit.runtime.messages import Activation, Gradient, StateMsg, Tag


class NonFiniteLossError(RuntimeError):
    """A loss became NaN or inf; the message names the round and client."""


@dataclass(frozen=True)
class HostSpec:
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
    persist_client_models: bool = False
    extra: dict = field(default_factory=dict)  # algorithm parameters the hosts need


def build_parts(spec: HostSpec) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Client part and server part of the configured model (random init; callers load states)."""
    from raysplit.models import build_model

    model = build_model(spec.model, spec.num_classes, tuple(spec.input_shape), **spec.model_options)
    if spec.cut is None:
        return model, torch.nn.Identity()
    return model.split(spec.cut)


def make_optimizer(params, cfg: dict) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg["lr"])  # placeholder (Identity part)
    if cfg["name"] == "sgd":
        return torch.optim.SGD(params, lr=cfg["lr"], momentum=cfg.get("momentum", 0.0),
                               weight_decay=cfg.get("weight_decay", 0.0), nesterov=cfg.get("nesterov", False))
    if cfg["name"] == "adam":
        return torch.optim.Adam(params, lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.0))
    if cfg["name"] == "adamw":
        return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.0))
    raise ValueError(f"unknown optimizer {cfg['name']!r}")


def round_lr(cfg: dict, rnd: int) -> float:
    """Learning rate of round ``rnd``: ``max(lr * decay**rnd, min_lr)`` (Hydra's per-epoch decay)."""
    return max(cfg["lr"] * cfg.get("decay", 1.0) ** max(rnd, 0), cfg.get("min_lr", 0.0))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def average_states(states: list[dict], weights: list[float]) -> dict[str, torch.Tensor]:
    """Weighted average of state dicts (integer buffers such as num_batches_tracked are rounded back)."""
    total = float(sum(weights))
    out = {}
    for k in states[0]:
        acc = sum(torch.as_tensor(s[k]).double() * (w / total) for s, w in zip(states, weights))
        ref = torch.as_tensor(states[0][k])
        out[k] = acc.round().to(ref.dtype) if not ref.is_floating_point() else acc.to(ref.dtype)
    return out


def average_optimizer_states(opt_states: list[dict], weights: list[float]) -> dict | None:
    """Weighted average of optimizer state dicts of identical parameter layouts (momentum buffers, Adam moments);
    None when the optimizer keeps no state (plain SGD)."""
    if not opt_states[0]["state"]:
        return None
    merged = copy.deepcopy(opt_states[0])
    for pid in merged["state"]:
        merged["state"][pid] = average_states([o["state"][pid] for o in opt_states], weights)
    return merged


def _clone_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@dataclass
class _Slot:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer


class _Counters:
    def __init__(self):
        self.v = defaultdict(float)

    def add(self, **kw):
        for k, x in kw.items():
            self.v[k] += x


class ClientHost:
    """Hosts a set of virtual clients on one worker."""

    def __init__(self, spec: HostSpec, worker_index: int, data: dict, train_idx: dict[int, np.ndarray],
                 test_idx: dict[int, np.ndarray], profiles: dict[int, ClientProfile], init_state: dict):
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        torch.manual_seed(spec.seed * 1009 + worker_index)
        self.spec = spec
        self.worker_index = worker_index
        self.x, self.y = data["x"], data["y"]
        self.train_idx = {int(c): np.asarray(v) for c, v in train_idx.items()}
        self.test_idx = {int(c): np.asarray(v) for c, v in test_idx.items()}
        self.profiles = {int(c): p for c, p in profiles.items()}
        self.global_state = transport.unpack_state(init_state)
        self.own: dict[int, dict] = {}
        self.opt_state: dict[int, dict] = {}
        self.cursor: dict[int, tuple[int, int]] = {c: (0, 0) for c in self.train_idx}
        self._perm: dict[int, tuple[int, np.ndarray]] = {}
        self.clock: dict[int, float] = {c: 0.0 for c in self.train_idx}
        self.slots: dict[int, _Slot] = {}
        self._pool: list[torch.nn.Module] = []
        self.pending: dict[Tag, torch.Tensor] = {}
        self.flops = FlopCache()
        self.round_stats: dict[int, _Counters] = defaultdict(_Counters)
        self.totals: dict[int, _Counters] = defaultdict(_Counters)
        self.round = -1

    # ---- virtual-client bookkeeping -------------------------------------------------------------------------
    def _new_module(self) -> torch.nn.Module:
        if self._pool:
            return self._pool.pop()
        client, _ = build_parts(self.spec)
        return client

    def activate(self, cid: int) -> _Slot:
        if cid in self.slots:
            return self.slots[cid]
        if cid not in self.train_idx:
            raise KeyError(f"client {cid} is not hosted by worker {self.worker_index}")
        module = self._new_module()
        module.load_state_dict(self.own.get(cid, self.global_state))
        module.train()
        opt = make_optimizer(module.parameters(), self.spec.client_optimizer)
        if cid in self.opt_state:
            opt.load_state_dict(self.opt_state[cid])
        set_lr(opt, round_lr(self.spec.client_optimizer, self.round))
        self.slots[cid] = _Slot(module, opt)
        return self.slots[cid]

    def release(self, cid: int, keep_weights: bool | None = None) -> None:
        slot = self.slots.pop(cid, None)
        if slot is None:
            return
        if keep_weights if keep_weights is not None else self.spec.persist_client_models:
            self.own[cid] = _clone_state(slot.module)
        st = slot.optimizer.state_dict()
        if st["state"]:
            self.opt_state[cid] = copy.deepcopy(st)
        self._pool.append(slot.module)

    def next_batch(self, cid: int, batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        bs = batch_size or self.spec.batch_size
        idx_all = self.train_idx[cid]
        epoch, pos = self.cursor[cid]
        if pos >= len(idx_all):
            epoch, pos = epoch + 1, 0
        cached = self._perm.get(cid)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.spec.seed, cid, epoch])
            cached = (epoch, rng.permutation(idx_all))
            self._perm[cid] = cached
        idx = cached[1][pos:pos + bs]
        self.cursor[cid] = (epoch, pos + len(idx))
        x = to_tensor(self.x[idx], self.spec.data_spec)
        y = torch.as_tensor(np.asarray(self.y[idx]), dtype=torch.long)
        return x, y

    def begin_round(self, rnd: int, cids: list[int], t0: float) -> None:
        self.round = rnd
        self.round_stats.clear()
        for c in cids:
            if c in self.clock:
                self.clock[c] = t0

    def _charge_compute(self, cid: int, flops: float) -> None:
        self.clock[cid] += flops / self.profiles[cid].flops
        self.round_stats[cid].add(flops=flops)

    # ---- split-learning steps -------------------------------------------------------------------------------
    def forward(self, tag: Tag, batch_size: int | None = None) -> Activation:
        cid = tag.client
        slot = self.activate(cid)
        x, y = self.next_batch(cid, batch_size)
        out, fl = self.flops.run(("fwd", tuple(x.shape)), lambda: slot.module(x))
        self.pending[tag] = out
        self._charge_compute(cid, fl)
        msg = Activation(tag, transport.pack(out), y.numpy(), 0.0, float(len(self.train_idx[cid])))
        self.clock[cid] += msg.nbytes / self.profiles[cid].up
        msg.t_sent = self.clock[cid]
        self.round_stats[cid].add(bytes_up=msg.nbytes)
        return msg

    def backward(self, grad: Gradient) -> float:
        """Apply the gradient for the activation with the same tag; returns the client's clock."""
        tag = grad.tag
        try:
            out = self.pending.pop(tag)
        except KeyError:
            raise KeyError(f"gradient for {tag} has no pending activation on worker {self.worker_index}; "
                           f"pending: {sorted(self.pending)[:5]}") from None
        cid = tag.client
        slot = self.slots[cid]
        prof = self.profiles[cid]
        self.clock[cid] = max(self.clock[cid], grad.t_sent) + grad.nbytes / prof.down
        self.round_stats[cid].add(bytes_down=grad.nbytes, steps=1)
        if grad.g is None:
            return self.clock[cid]
        g = transport.unpack(grad.g)
        slot.optimizer.zero_grad(set_to_none=True)
        _, fl = self.flops.run(("bwd", tuple(out.shape)), lambda: out.backward(g))
        slot.optimizer.step()
        self._charge_compute(cid, fl)
        return self.clock[cid]

    def local_train(self, cid: int, steps: int) -> float:
        """Plain local SGD of the hosted part on the client's data (FedAvg); returns the mean loss."""
        slot = self.activate(cid)
        losses = []
        for _ in range(steps):
            x, y = self.next_batch(cid)

            def fwd_bwd():
                slot.optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(slot.module(x), y)
                loss.backward()
                return loss

            loss, fl = self.flops.run(("train", tuple(x.shape)), fwd_bwd)
            if not math.isfinite(loss.item()):
                raise NonFiniteLossError(f"non-finite loss {loss.item()} at round {self.round}, client {cid}")
            slot.optimizer.step()
            self._charge_compute(cid, fl)
            self.round_stats[cid].add(steps=1, loss_sum=loss.item(), loss_n=1)
            losses.append(loss.item())
        return float(np.mean(losses))

    # ---- model movement ------------------------------------------------------------------------------------
    def _state_of(self, cid: int) -> dict:
        if cid in self.slots:
            return self.slots[cid].module.state_dict()
        return self.own.get(cid, self.global_state)

    def _send_state(self, cid: int, state: dict) -> float:
        nb = transport.state_nbytes(state)
        self.clock[cid] += nb / self.profiles[cid].up
        self.round_stats[cid].add(bytes_up=nb)
        return self.clock[cid]

    def partial_sum(self, weights: dict[int, float]) -> StateMsg | None:
        """Weighted sum of the hosted clients' current weights (upload counted per client)."""
        mine = [(c, w) for c, w in weights.items() if int(c) in self.train_idx]
        if not mine:
            return None
        acc, t = None, 0.0
        for c, w in mine:
            st = self._state_of(int(c))
            t = max(t, self._send_state(int(c), st))
            term = {k: v.detach().double() * w for k, v in st.items()}
            acc = term if acc is None else {k: acc[k] + term[k] for k in acc}
        return StateMsg(transport.pack_state(acc), t_sent=t, weight=float(sum(w for _, w in mine)))

    def set_global(self, msg: StateMsg, receivers: list[int] | None = None, only: list[int] | None = None) -> None:
        """Install an aggregate: for all clients (``only`` None) or as the own model of the clients in ``only``.
        Download bytes and time are charged to ``receivers`` (the round's clients) that this host holds."""
        state = transport.unpack_state(msg.state)
        nb = transport.state_nbytes(state)
        if only is None:
            self.global_state = state
            if not self.spec.persist_client_models:
                self.own.clear()
        else:
            for c in only:
                if int(c) in self.train_idx:
                    self.own[int(c)] = state
        for c in receivers or []:
            c = int(c)
            if c in self.train_idx:
                if c in self.slots:
                    self.slots[c].module.load_state_dict(state)
                self.clock[c] = max(self.clock[c], msg.t_sent) + nb / self.profiles[c].down
                self.round_stats[c].add(bytes_down=nb)

    def get_state(self, cid: int) -> StateMsg:
        st = self._state_of(cid)
        t = self._send_state(cid, st)
        return StateMsg(transport.pack_state(st), t_sent=t, weight=float(len(self.train_idx[cid])))

    def load_state(self, cid: int, msg: StateMsg) -> None:
        """Receive a model (hand-over in sequential split learning) as this client's own."""
        state = transport.unpack_state(msg.state)
        nb = transport.state_nbytes(state)
        self.own[cid] = state
        if cid in self.slots:
            self.slots[cid].module.load_state_dict(state)
        self.clock[cid] = max(self.clock[cid], msg.t_sent) + nb / self.profiles[cid].down
        self.round_stats[cid].add(bytes_down=nb)

    def end_round(self) -> dict[int, dict]:
        if self.pending:
            raise RuntimeError(f"worker {self.worker_index}: round {self.round} ended with activations that never "
                               f"got a gradient: {sorted(self.pending)[:5]}")
        for c in list(self.slots):
            self.release(c)
        out = {}
        for c, cnt in self.round_stats.items():
            out[c] = dict(cnt.v, t_end=self.clock[c])
            self.totals[c].add(**cnt.v, rounds=1)
        return out

    # ---- evaluation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate_clients(self, cids: list[int], server_state: StateMsg) -> tuple[np.ndarray, np.ndarray, float]:
        """Each client's own test split through its own client model and the given server model."""
        client, server = build_parts(self.spec)
        server.load_state_dict(transport.unpack_state(server_state.state))
        client.eval(), server.eval()
        ys, ps, loss = [], [], 0.0
        for c in cids:
            c = int(c)
            if c not in self.test_idx or len(self.test_idx[c]) == 0:
                continue
            client.load_state_dict(self._state_of(c))
            idx = self.test_idx[c]
            for i in range(0, len(idx), self.spec.eval_batch_size):
                b = idx[i:i + self.spec.eval_batch_size]
                out = server(client(to_tensor(self.x[b], self.spec.data_spec)))
                y = torch.as_tensor(np.asarray(self.y[b]), dtype=torch.long)
                loss += F.cross_entropy(out, y, reduction="sum").item()
                ys.append(y.numpy()), ps.append(out.argmax(1).numpy())
        if not ys:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0
        return np.concatenate(ys), np.concatenate(ps), loss

    # ---- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.slots or self.pending:
            raise RuntimeError("checkpoint requested in the middle of a round")
        return {"global": self.global_state, "own": self.own, "opt": self.opt_state, "cursor": self.cursor,
                "clock": self.clock, "totals": {c: dict(v.v) for c, v in self.totals.items()},
                "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, st: dict) -> None:
        self.global_state, self.own, self.opt_state = st["global"], st["own"], st["opt"]
        self.cursor, self.clock = dict(st["cursor"]), dict(st["clock"])
        self.totals = defaultdict(_Counters)
        for c, v in st["totals"].items():
            self.totals[c].add(**v)
        torch.set_rng_state(st["torch_rng"])
        self._perm.clear()

    def clocks(self, cids: list[int]) -> dict[int, float]:
        """Simulated time of the given hosted clients (asynchronous algorithms order events by it)."""
        return {int(c): self.clock[int(c)] for c in cids if int(c) in self.clock}

    def client_totals(self) -> dict[int, dict]:
        return {c: dict(v.v) for c, v in self.totals.items()}


class ServerHost:
    """Owns the server-side model(s) and optimizer(s). ``models['main']`` is the server model; per-client copies
    (PSL, SFLV1) are forked from it and merged back by weighted averaging."""

    def __init__(self, spec: HostSpec, init_state: dict, client_init_state: dict, test: dict):
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        torch.manual_seed(spec.seed * 1009 + 7919)
        self.spec = spec
        want = spec.device
        self.device = torch.device("cuda" if want in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
        client, server = build_parts(spec)
        server.load_state_dict(transport.unpack_state(init_state))
        server.to(self.device).train()
        self.models: dict = {"main": _Slot(server, make_optimizer(server.parameters(), spec.server_optimizer))}
        self._eval_client = client.to(self.device)
        self.test_x, self.test_y = test["x"], test["y"]
        self.flops = FlopCache()
        self.clock = 0.0
        self.round = -1
        self._reset_round()

    def _reset_round(self):
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.round_flops = 0.0
        self.nonfinite: Tag | None = None
        self.busy_wall = 0.0

    def begin_round(self, rnd: int, t0: float) -> None:
        self.round = rnd
        self.clock = max(self.clock, t0)
        self._reset_round()
        for slot in self.models.values():
            set_lr(slot.optimizer, round_lr(self.spec.server_optimizer, rnd))

    def charge(self, flops: float, ready_at: float = 0.0) -> float:
        """Advance the server clock by a computation that can start once ``ready_at`` has passed."""
        self.clock = max(self.clock, ready_at) + flops / self.spec.server_flops
        self.round_flops += flops
        return self.clock

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor, act: Activation) -> torch.Tensor:
        return F.cross_entropy(out, y)

    def train_step(self, act: Activation, key="main") -> Gradient:
        """Forward the activation through ``models[key]``, step it, return dL/d(activation) to the client."""
        slot = self.models[key]
        return self.step_through(act, slot.module, [slot.optimizer], "main" if key == "main" else "copy")

    def step_through(self, act: Activation, module, optimizers: list, flop_key="main") -> Gradient:
        """One SGD step of ``module`` (and its ``optimizers``) on an activation; returns the client's gradient."""
        t_wall = time.perf_counter()
        x = transport.unpack(act.x, self.device, writable=True).requires_grad_(True)
        y = torch.tensor(act.y, device=self.device)

        def step():
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss = self.loss_fn(module(x), y, act)
            loss.backward()
            return loss

        loss, fl = self.flops.run(("train", flop_key, tuple(x.shape)), step)
        lv = float(loss.item())
        self._check(lv, act.tag)
        for opt in optimizers:
            opt.step()
        self.charge(fl, act.t_sent)
        g = x.grad
        self.losses.append(lv)
        self.grad_norms.append(float(g.norm()))
        self.busy_wall += time.perf_counter() - t_wall
        return Gradient(act.tag, transport.pack(g), self.clock, lv)

    def _check(self, loss: float, tag: Tag) -> None:
        if not math.isfinite(loss) and self.nonfinite is None:
            self.nonfinite = tag
            if self.spec.extra.get("stop_on_nonfinite", True):
                raise NonFiniteLossError(f"non-finite loss {loss} at round {tag.round}, client {tag.client} "
                                         f"(step {tag.step})")

    # ---- per-client copies ------------------------------------------------------------------------------------
    def fork(self, keys: list) -> None:
        main = self.models["main"]
        for k in keys:
            module = copy.deepcopy(main.module)
            opt = make_optimizer(module.parameters(), self.spec.server_optimizer)
            opt.load_state_dict(main.optimizer.state_dict())  # carries the round's lr too
            self.models[k] = _Slot(module, opt)

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
        parts = [p for p in partials if p is not None]
        total = sum(p.weight for p in parts)
        keys = parts[0].state.keys()
        # torch.as_tensor, not from_numpy: a 0-d entry (BatchNorm's num_batches_tracked) sums to a numpy scalar
        avg = {k: torch.as_tensor(sum(np.asarray(p.state[k], dtype=np.float64) for p in parts) / total) for k in keys}
        ref = self._eval_client.state_dict()
        state = {k: (v if ref[k].is_floating_point() else v.round()).to(ref[k].dtype) for k, v in avg.items()}
        return StateMsg(transport.pack_state(state), t_sent=max(p.t_sent for p in parts), weight=total)

    def get_state(self, key="main") -> StateMsg:
        return StateMsg(transport.pack_state(self.models[key].module.state_dict()), t_sent=self.clock)

    # ---- evaluation ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, client_state: StateMsg, key="main") -> tuple[np.ndarray, np.ndarray, float]:
        client, server = self._eval_client, self.models[key].module
        client.load_state_dict(transport.unpack_state(client_state.state))
        client.eval(), server.eval()
        preds, loss = [], 0.0
        bs = self.spec.eval_batch_size
        for i in range(0, len(self.test_y), bs):
            x = to_tensor(self.test_x[i:i + bs], self.spec.data_spec).to(self.device)
            y = torch.tensor(self.test_y[i:i + bs], dtype=torch.long, device=self.device)
            out = server(client(x))
            loss += F.cross_entropy(out, y, reduction="sum").item()
            preds.append(out.argmax(1).cpu().numpy())
        server.train()
        return np.asarray(self.test_y), np.concatenate(preds) if preds else np.zeros(0, np.int64), loss

    def end_round(self) -> dict:
        if self.nonfinite is not None and self.spec.extra.get("stop_on_nonfinite", True):
            t = self.nonfinite
            raise NonFiniteLossError(f"non-finite loss at round {t.round}, client {t.client} (step {t.step})")
        return {"losses": self.losses, "grad_norms": self.grad_norms, "flops": self.round_flops,
                "t_end": self.clock, "busy_wall": self.busy_wall}

    # ---- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"models": {k: (s.module.state_dict(), s.optimizer.state_dict()) for k, s in self.models.items()},
                "clock": self.clock, "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, st: dict) -> None:
        for k, (ms, os_) in st["models"].items():
            if k not in self.models:
                self.fork([k])
            self.models[k].module.load_state_dict(ms)
            self.models[k].optimizer.load_state_dict(os_)
        self.clock = st["clock"]
        torch.set_rng_state(st["torch_rng"])
