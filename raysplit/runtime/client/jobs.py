"""A client host's local training: FedAvg's local SGD in a round, and the event driver's asynchronous jobs (join,
local steps, leave)."""

from __future__ import annotations

import numpy as np

from raysplit.runtime import transport
from raysplit.runtime.state import ModelSlot
from raysplit.runtime.screening import Deferred, check_loss
from raysplit.runtime.messages import StateMsg


class LocalJobs:
    """A client's training on its own (no server step), in a round (``local_train``) or in the event driver's
    jobs (a component of the client host). ``job_round``: the global round each active client's job began in;
    ``job_loss``: the mean loss of a local job, sent with the model."""

    client_fields: tuple[str, ...] = ("job_round", "job_loss")  # per-client state that moves with a client

    def __init__(self, plan, slots, data, meter, states, executor, cut, transfers, worker_index: int):
        self.slots, self.data, self.meter, self.states = slots, data, meter, states
        self.executor, self.cut, self.transfers = executor, cut, transfers
        self.stop_on_nonfinite = plan.sections.train.stop_on_nonfinite
        self.worker_index = worker_index
        self.job_round: dict[int, int] = {}
        self.job_loss: dict[int, float] = {}

    @property
    def round(self) -> int:
        return self.slots.progress.round

    def local_train(self, cid: int, steps: int) -> float:
        """Plain local SGD of the hosted part on the client's data (FedAvg); returns the mean loss (the call's one
        read of the device: a step's loss stays there, checked at the round's end)."""
        slot = self.slots.activate(cid)
        with self.executor.seeded(cid, 1, self.round):
            return mean_loss([self._local_step(cid, slot) for _ in range(steps)])

    def local_train_many(self, steps: dict[int, int]) -> dict[int, float]:
        """:meth:`local_train` for each client of ``steps`` this host holds (``steps[c]`` batches); returns each
        one's mean loss. With packing on (``runtime.pack_clients``, :attr:`Executor.pack`), at each step the
        clients whose batches have equal shapes train as one batched computation
        (:meth:`~raysplit.runtime.client.executor.Executor.train_together`), each client's own optimizer then stepping on
        its own gradients (the rule's ``before_step`` and clipping first, as always); a batch of its own shape (a
        short last one) or a model vmap refuses trains alone, its randomness drawn per step. Packed, a client's
        result equals its one-at-a-time result within float rounding, not bit for bit, and so does a run on another
        number of client actors (which changes which clients share a computation)."""
        mine = [int(c) for c in steps if int(c) in self.data]
        if not self.executor.pack or len(mine) < 2:
            return {c: self.local_train(c, steps[c]) for c in mine}
        slots = {c: self.slots.activate(c) for c in mine}
        losses: dict[int, list] = {c: [] for c in mine}
        for s in range(max(steps[c] for c in mine)):
            batch = {c: self.data.batch(self.data.draw(c)) for c in mine if s < steps[c]}
            shapes: dict[tuple, list[int]] = {}
            for c, (x, y) in batch.items():
                shapes.setdefault((tuple(x.shape), tuple(y.shape)), []).append(c)
            for shape, cs in shapes.items():
                done = None if len(cs) < 2 else self.executor.train_together(
                    ("train", shape[0]), [slots[c].module for c in cs], [batch[c][0] for c in cs],
                    [batch[c][1] for c in cs])
                for i, c in enumerate(cs):
                    if done is None:
                        with self.executor.seeded(c, 1, self.round, s):
                            losses[c].append(self._local_step(c, slots[c], batch[c]))
                        continue
                    lv, fl = done[i]
                    check_loss(self.executor.deferred, lv, self.stop_on_nonfinite, f"round {self.round}, client {c}")
                    self.slots.update(c, slots[c])
                    self.meter.charge_compute(c, fl)
                    self.meter.count(c, steps=1, loss_sum=lv, loss_n=1)
                    losses[c].append(lv)
        return dict(zip(losses, mean_losses(list(losses.values()))))

    def _local_step(self, cid: int, slot: ModelSlot, batch: tuple | None = None, deferred: Deferred | None = None):
        """One local SGD step; its loss (a 0-d tensor), checked with ``deferred`` (default: the round's)."""
        x, y = batch if batch is not None else self.data.batch(self.data.draw(cid))

        def fwd_bwd():
            slot.optimizer.zero_grad(set_to_none=True)
            loss = self.executor.loss(slot.module(x), y)
            loss.backward()
            return loss

        loss, fl = self.executor.run(("train", tuple(x.shape)), fwd_bwd)
        loss = loss.detach()
        check_loss(deferred or self.executor.deferred, loss, self.stop_on_nonfinite,
                   f"round {self.round}, client {cid}")
        self.slots.update(cid, slot)
        self.meter.charge_compute(cid, fl)
        self.meter.count(cid, steps=1, loss_sum=loss, loss_n=1)
        return loss


    def join(self, cid: int, msg: StateMsg, t0: float, rnd: int) -> float:
        """Client ``cid`` takes a free slot at simulated time ``t0`` and starts from the global model ``msg``
        (download charged); ``rnd`` is the global round (learning rate, randomness). Returns its clock."""
        if cid in self.states.slots:
            raise RuntimeError(f"client {cid} joins while its previous job is still active on worker "
                               f"{self.worker_index}")
        state = transport.unpack_state(msg.state)
        self.meter.start(cid, t0)
        self.job_round[cid] = rnd
        self.slots.dropped.pop(cid, None)
        self.slots.activate(cid, state=state, rnd=rnd)
        return self.meter.charge_download(cid, transport.state_nbytes(state), msg.t_sent, "model")

    def local_job(self, cid: int, steps: int) -> float:
        """``steps`` local SGD batches of the client's whole part (asynchronous FL); returns the mean loss."""
        slot = self.states.slots[cid]
        checks = Deferred()  # a job has no round's end: its losses are checked as it ends
        with self.executor.seeded(cid, 1, self.job_round.get(cid, 0)):
            losses = [self._local_step(cid, slot, deferred=checks) for _ in range(steps)]
        checks.settle()
        self.job_loss[cid] = mean_loss(losses)
        return self.job_loss[cid]

    def leave(self, cid: int) -> StateMsg:
        """The client uploads its model (upload charged) and frees its slot; the host's deferred checks are judged
        first (a job has no round's end)."""
        self.executor.deferred.settle()
        msg = self.transfers.send(cid)
        msg.state = {k: np.array(v, copy=True) for k, v in msg.state.items()}  # the slot's module is reused
        msg.loss = self.job_loss.pop(cid, float("nan"))
        msg.rejected = self.slots.dropped.get(cid, "")
        if self.cut.accounted:  # what end_round reports in synchronous rounds
            msg.epsilon = self.cut.epsilon(cid)
        self.slots.release(cid, keep_weights=False)
        return msg


def mean_losses(groups: list[list]) -> list[float]:
    """The mean of each group of losses (0-d tensors or floats), in one read of the device: each the mean of the
    losses as floats, as :func:`numpy.mean` takes it."""
    flat = transport.read_floats([v for g in groups for v in g])
    out, at = [], 0
    for g in groups:
        out.append(float(np.mean(flat[at:at + len(g)])))
        at += len(g)
    return out


def mean_loss(losses: list) -> float:
    return mean_losses([losses])[0]
