"""A client host's local training: FedAvg's local SGD in a round, and the event driver's asynchronous jobs (join,
local steps, leave)."""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F

from raysplit.runtime import transport
from raysplit.runtime.hostspec import ModelSlot, check_finite
from raysplit.runtime.messages import StateMsg


class ClientJobs:
    """Mixed into :class:`~raysplit.runtime.client_host.ClientHost`: a client's training on its own (no server
    step), in a round (``local_train``) or in the event driver's jobs."""

    def local_train(self, cid: int, steps: int) -> float:
        """Plain local SGD of the hosted part on the client's data (FedAvg); returns the mean loss."""
        slot = self.activate(cid)
        with self.executor.seeded(cid, 1, self.round):
            return float(np.mean([self._local_step(cid, slot) for _ in range(steps)]))

    def _local_step(self, cid: int, slot: ModelSlot) -> float:
        x, y = self.data.batch(self.data.draw(cid))

        def fwd_bwd():
            slot.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(slot.module(x), y)
            loss.backward()
            return loss

        loss, fl = self.executor.run(("train", tuple(x.shape)), fwd_bwd)
        check_finite(loss.item(), self.spec.stop_on_nonfinite, f"round {self.round}, client {cid}")
        self._update(cid, slot)
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
        self.dropped.pop(cid, None)
        self.activate(cid, state=state, rnd=rnd)
        return self.meter.charge_download(cid, transport.state_nbytes(state), msg.t_sent, "model")

    def local_job(self, cid: int, steps: int) -> float:
        """``steps`` local SGD batches of the client's whole part (asynchronous FL); returns the mean loss."""
        slot = self.states.slots[cid]
        with self.executor.seeded(cid, 1, self.job_round.get(cid, 0)):
            self.job_loss[cid] = float(np.mean([self._local_step(cid, slot) for _ in range(steps)]))
        return self.job_loss[cid]

    def leave(self, cid: int) -> StateMsg:
        """The client uploads its model (upload charged) and frees its slot."""
        msg = self.get_state(cid)
        msg.state = {k: np.array(v, copy=True) for k, v in msg.state.items()}  # the slot's module is reused
        msg.loss = self.job_loss.pop(cid, float("nan"))
        msg.rejected = self.dropped.get(cid, "")
        if self.cut.accounted:  # what end_round reports in synchronous rounds
            msg.epsilon = self.cut.epsilon(cid)
        self.release(cid, keep_weights=False)
        return msg
