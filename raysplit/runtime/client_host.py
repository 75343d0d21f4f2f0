"""The client host: many virtual clients on one worker (see :mod:`raysplit.runtime.hosts`)."""

from __future__ import annotations

import contextlib
import copy
import zlib
from collections import defaultdict
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from raysplit.clock import ClientProfile, FlopCache
from raysplit.data import to_tensor
from raysplit.privacy import ATTACK_PLUGINS, AttackView, CutDefence, distance_correlation, reconstruction_scores
from raysplit.runtime import transport
from raysplit.runtime.aggregation import weighted_sum
from raysplit.runtime.messages import Activation, Gradient, StateMsg, Tag
from raysplit.runtime.optim import make_optimizer, round_lr, set_lr
from raysplit.runtime.spill import SpillStore
from raysplit.runtime.hostspec import (Checkpointed, HostSpec, ModelSlot, _Counters, _bad_input,
                                       _clone_state, advance_cursor, build_parts, check_finite, limit_threads)
from raysplit.runtime.screening import gradient_fault, screens_nonfinite, where_of
from raysplit.runtime.evaluation import EvalTally, predict_batches
from raysplit.runtime.client_jobs import ClientJobs
from raysplit.runtime.client_moves import ClientMoves


class ClientHost(ClientJobs, ClientMoves, Checkpointed):
    """Hosts a set of virtual clients on one worker; ``train_idx``'s keys are the clients it holds now."""

    # per-client mappings that move with a client to another host (``export_clients``); a subclass that keeps
    # per-client state of its own adds its attribute names (the attribute must be a dict keyed by client id)
    client_fields: tuple[str, ...] = ("train_idx", "test_idx", "profiles", "own", "opt_state", "cursor", "clock",
                                      "totals", "last_active", "job_round", "job_loss", "dp_releases")

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
        priv = spec.privacy
        self.defence = CutDefence(priv) if priv is not None and priv.defence != "none" else None
        self._leak: dict[Tag, tuple[torch.Tensor, torch.Tensor]] = {}  # NoPeek: (inputs, activation) per tag
        self.dp_releases: dict[int, dict[float, int]] = {}  # noised releases per client: {sampling rate: count}

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
        epoch, start, stop = advance_cursor(len(idx_all), batch_size or self.spec.batch_size, self.cursor[cid],
                                            self.spec.drop_last)
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
        self.clock[cid] = self.profiles[cid].after_compute(self.clock[cid], flops)
        self.round_stats[cid].add(flops=flops)

    def charge_upload(self, cid: int, nbytes: int, kind: str) -> float:
        """Client ``cid`` sends ``nbytes`` of ``kind`` (activations, model, labels): counted in total and by kind."""
        self._dirty.add(cid)
        self.clock[cid] = self.profiles[cid].after_upload(self.clock[cid], nbytes)
        self.round_stats[cid].add(bytes_up=nbytes, **{f"bytes_up_{kind}": nbytes})
        return self.clock[cid]

    def charge_download(self, cid: int, nbytes: int, t_sent: float, kind: str) -> float:
        """A message of ``nbytes`` of ``kind`` (gradients, model) sent at ``t_sent`` reaches client ``cid`` (which
        may still be busy); with ``charge_server`` off (GAS's code) the transfer takes no time."""
        self._dirty.add(cid)
        self.clock[cid] = self.profiles[cid].after_download(self.clock[cid], t_sent, nbytes, self.spec.charge_server)
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
        nbytes = None
        if self.defence is not None:
            out, nbytes = self.defend(tag, x, out)
        self.pending[tag] = out
        self.charge_compute(cid, fl)
        msg = Activation(tag, transport.pack(out), y, 0.0, float(len(self.train_idx[cid])))
        msg.t_sent = self.charge_upload(cid, msg.nbytes if nbytes is None else nbytes + msg.y.nbytes, "activations")
        return msg

    def defend(self, tag: Tag, x: torch.Tensor, out: torch.Tensor,
               count: bool = True, rate: float | None = None) -> tuple[torch.Tensor, int | None]:
        """``privacy.defence`` on the client side of the cut: what leaves instead of ``out`` (noise drawn from its
        own per-step stream, so the encoder's randomness is unchanged), and its bytes (None: the tensor's own).
        NoPeek keeps (inputs, activation) for its loss term in :meth:`backward`; a noised release is counted
        against the client's budget at rate batch / its samples (``count``: not when a checkpoint rebuilds it;
        ``rate``: another sampling rate, 1 for a transfer of every sample once)."""
        cid = tag.client
        with self.seeded(cid, 2, tag.round, tag.step, zlib.crc32(tag.stream.encode())):
            sent, nbytes = self.defence.release(out)
        if self.defence.spec.defence == "nopeek" and out.requires_grad:
            self._leak[tag] = (x, out)
        if count and self.defence.spec.accounted:
            q = rate if rate is not None else round(len(x) / len(self.train_idx[cid]), 12)
            book = self.dp_releases.setdefault(cid, {})
            book[q] = book.get(q, 0) + 1
        return sent, nbytes

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
        leak = self._leak.pop(tag, None)
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
        if leak is not None:  # NoPeek's term first (its graph is the activation's), then the server's gradient
            self.defence.loss(*leak).backward(retain_graph=True)
        fl = self.backward_pass(tag, out, g)
        self.before_step(cid, slot)
        slot.optimizer.step()
        self.charge_compute(cid, fl)
        return self.clock[cid]

    def drop(self, cid: int, why: str) -> None:
        """Client ``cid`` takes no further part in this round (job): no more updates, left out of aggregation, its
        own model and optimizer state stay as they were before the round (``runtime.faults.on_bad_client: drop``)."""
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


    def end_round(self) -> dict[int, dict]:
        for tag in [t for t in self.pending if t.client in self.dropped]:  # never answered: its tag was forged
            del self.pending[tag]
            self._leak.pop(tag, None)
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
            if self.defence is not None and self.defence.spec.accounted:
                out[c]["dp_epsilon"] = self.defence.epsilon(self.dp_releases.get(c, {}))
        return out

    # ---- evaluation ----------------------------------------------------------------------------------------
    def reconstruction(self, cids: list[int], rnd: int, global_state: StateMsg | None = None) -> dict[int, dict]:
        """``privacy.attack`` against the clients of ``cids`` this host holds, scored on the first ``samples`` of
        the client's training inputs in a seeded order, encoded by the client's current model with its defence
        applied (what the server receives for them), by the attack's plug-in (``privacy.ATTACK_PLUGINS``) given
        what the server would have: for ``reconstruction`` the auxiliary set encoded and defended the same way,
        for ``inversion`` ``global_state``, the averaged client model the server holds (where the client's own
        model has moved since the average, the attacker inverts through the wrong model, as it would). Runs here
        because the score needs the inputs (ground truth the attacker never sees). Returns per client its scores,
        the distance correlation of those inputs and what the server receives for them (``dcor``, the leakage
        NoPeek minimises), and the first 8 (input, reconstruction) pairs."""
        priv = self.spec.privacy
        attack = ATTACK_PLUGINS[priv.attack](priv)
        mine = [int(c) for c in cids if int(c) in self.train_idx]
        held = lo = hi = None
        if attack.needs_held_model and mine:
            held = self.build_module()
            held.load_state_dict(global_state.tensors())
            held.eval()
            lo, hi = to_tensor(priv.input_range, self.spec.data_spec).split(1)
        aux = to_tensor(priv.aux_x, self.spec.data_spec) if mine and attack.needs_aux else None
        out = {}
        for c in mine:
            module = self.build_module()
            module.load_state_dict(self._state_of(c))
            module.eval()
            encode = self.encoder(Tag(c, rnd, 0, "attack"), ModelSlot(module, None))

            def sent(x):  # what the server receives for inputs x
                return encode(x) if self.defence is None else self.defence.release(encode(x))[0]

            order = np.random.default_rng([self.spec.seed, 0xA77, c]).permutation(self.train_idx[c])
            victim = to_tensor(self.x[np.sort(order[:priv.samples])], self.spec.data_spec)
            with torch.no_grad(), self.seeded(c, 3, rnd):
                z_aux = sent(aux) if aux is not None else None
                z_vic = sent(victim)
            rec = attack.reconstruct(AttackView(
                z_vic, aux=aux, z_aux=z_aux, lo=lo, hi=hi, seed=self.spec.seed * 7919 + c,
                held=self.encoder(Tag(c, rnd, 0, "attack"), ModelSlot(held, None)) if held is not None else None))
            rec = rec.reshape(victim.shape)
            out[c] = {**reconstruction_scores(victim, rec), "dcor": float(distance_correlation(victim, z_vic)),
                      "images": (victim[:8].numpy(), rec[:8].numpy())}
            self._pool.append(module)
        if held is not None:
            self._pool.append(held)
        return out

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
