"""A client host's local training: FedAvg's local SGD in a round, and the event driver's asynchronous jobs (join,
local steps, leave)."""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F

from raysplit.runtime import transport
from raysplit.runtime.state import ModelSlot
from raysplit.runtime.screening import check_finite
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
        """Plain local SGD of the hosted part on the client's data (FedAvg); returns the mean loss."""
        slot = self.slots.activate(cid)
        with self.executor.seeded(cid, 1, self.round):
            return float(np.mean([self._local_step(cid, slot) for _ in range(steps)]))

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
        losses: dict[int, list[float]] = {c: [] for c in mine}
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
                    check_finite(lv, self.stop_on_nonfinite, f"round {self.round}, client {c}")
                    self.slots.update(c, slots[c])
                    self.meter.charge_compute(c, fl)
                    self.meter.count(c, steps=1, loss_sum=lv, loss_n=1)
                    losses[c].append(lv)
        return {c: float(np.mean(v)) for c, v in losses.items()}

    def _local_step(self, cid: int, slot: ModelSlot, batch: tuple | None = None) -> float:
        x, y = batch if batch is not None else self.data.batch(self.data.draw(cid))

        def fwd_bwd():
            slot.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(slot.module(x), y)
            loss.backward()
            return loss

        loss, fl = self.executor.run(("train", tuple(x.shape)), fwd_bwd)
        check_finite(loss.item(), self.stop_on_nonfinite, f"round {self.round}, client {cid}")
        self.slots.update(cid, slot)
        self.meter.charge_compute(cid, fl)
        self.meter.count(cid, steps=1, loss_sum=loss.item(), loss_n=1)
        return loss.item()


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
        with self.executor.seeded(cid, 1, self.job_round.get(cid, 0)):
            self.job_loss[cid] = float(np.mean([self._local_step(cid, slot) for _ in range(steps)]))
        return self.job_loss[cid]

    def leave(self, cid: int) -> StateMsg:
        """The client uploads its model (upload charged) and frees its slot."""
        msg = self.transfers.send(cid)
        msg.state = {k: np.array(v, copy=True) for k, v in msg.state.items()}  # the slot's module is reused
        msg.loss = self.job_loss.pop(cid, float("nan"))
        msg.rejected = self.slots.dropped.get(cid, "")
        if self.cut.accounted:  # what end_round reports in synchronous rounds
            msg.epsilon = self.cut.epsilon(cid)
        self.slots.release(cid, keep_weights=False)
        return msg
