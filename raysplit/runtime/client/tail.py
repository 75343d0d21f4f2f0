"""A U-shaped split step (``model.tail_cut``; raysplit/label_privacy.py says what it protects and how it is
attacked). The client holds the model's head and tail with the loss (a :class:`~raysplit.models.UClient`), the
server the middle, and one split step is three exchanges instead of two:

1. the client forwards its batch through the head and sends the activation **without its labels**
   (:meth:`ClientTail.keep` keeps them; an empty label array travels, which the server's screen accepts);
2. the server runs the middle (:meth:`MiddleSteps.middle_forward`) and sends its output;
3. the client runs the tail and the loss, back-propagates into the tail's weights and returns the gradient with
   respect to the middle's output, after its label defence (:meth:`ClientTail.step`): the one place a label
   attack can look;
4. the server back-propagates that gradient through the middle, steps its optimizer
   (:meth:`MiddleSteps.middle_backward`) and answers the activation's gradient as in any split step;
5. the client back-propagates it into the head and steps once over head and tail
   (:meth:`~raysplit.runtime.client.host.ClientHost.backward`).

Every exchange is charged: the middle's output as ``bytes_down_middle``, the returned gradient as
``bytes_up_tail_gradients``, the tail's FLOPs on the client's clock, the middle's forward and backward on the
server's, each starting once its input has arrived. The loop (runtime/stepping.py, ``USHAPED``) runs the same
calls in the same order on every transport. With the label attack on, the client scores what it released per
client and round (:func:`~raysplit.label_privacy.leak_scores`; on a language model the next tokens,
:func:`~raysplit.token_privacy.next_token_leak`), since scoring needs the labels it never sends.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch

from raysplit.label_privacy import UShapeSpec, defend_gradient, leak_scores
from raysplit.runtime import transport
from raysplit.runtime.screening import TAIL_LOSS, check_loss
from raysplit.runtime.messages import Activation, Batch, Gradient, MiddleOut, Tag, TailGradient
from raysplit.runtime.server.stepping import USHAPED
from raysplit.token_privacy import next_token_leak


class ClientTail:
    """A client host's side of a U-shaped step past its head: the labels it keeps, the tail step, and what a label
    attack would see of each client's released gradients this round."""

    def __init__(self, spec: UShapeSpec, executor, states, meter, stop_on_nonfinite: bool):
        self.spec, self.executor, self.states, self.meter = spec, executor, states, meter
        self.stop_on_nonfinite = stop_on_nonfinite
        # the labels of forwards whose middle output has not come yet: on the device and as host memory
        self.labels: dict[Tag, tuple[torch.Tensor, np.ndarray]] = {}
        # per client: what it released this round (on the device until the round's end) and the labels
        self.released: dict[int, list[tuple[torch.Tensor, np.ndarray]]] = {}

    def keep(self, tag: Tag, y: np.ndarray) -> np.ndarray:
        """The labels of the forward of ``tag`` stay here; what travels in their place (an empty array)."""
        y = np.asarray(y)
        self.labels[tag] = (torch.as_tensor(y, device=self.executor.device), y)
        return y[:0]

    def step(self, msg: MiddleOut | Gradient) -> TailGradient | Gradient:
        """The tail and the loss on the middle's output for one forward; the gradient returned to the server. A
        gradient the server withheld (``runtime.faults.on_bad_client: drop``) passes through unchanged."""
        if not isinstance(msg, MiddleOut):
            return msg
        tag, cid, meter, executor = msg.tag, msg.tag.client, self.meter, self.executor
        y, y_host = self.labels.pop(tag)
        slot = self.states.slots[cid]
        meter.charge_download(cid, msg.nbytes, msg.t_sent, "middle")
        z = transport.unpack(msg.z, executor.device, writable=True).requires_grad_(True)

        def tail():
            slot.optimizer.zero_grad(set_to_none=True)  # the head's gradients follow in backward, then one step
            loss = executor.loss(slot.module.tail(z), y)
            loss.backward()
            return loss

        with executor.seeded(cid, 4, tag.round, tag.step, zlib.crc32(tag.stream.encode())):
            loss, fl = executor.run(("tail", tuple(z.shape)), tail)
            g = defend_gradient(z.grad, self.spec.defence)
        lv = loss.detach()
        check_loss(executor.deferred, lv, self.stop_on_nonfinite,
                   f"round {tag.round}, client {cid} (step {tag.step})", order=(tag.round, tag.step, TAIL_LOSS))
        meter.charge_compute(cid, fl)
        meter.count(cid, loss_sum=lv, loss_n=1)
        g = g.detach()
        if self.spec.scored:
            self.released.setdefault(cid, []).append((g, y_host))
        return TailGradient(tag, g, meter.charge_upload(cid, transport.nbytes(g), "tail_gradients"), lv)

    def end_round(self, rows: dict[int, dict]) -> None:
        """The round is over: each scored client's row (``rows[c]``) gets the label attack's scores of what it
        released this round (``label_auc_norm``, ...); what was kept for the round goes."""
        for cid, got in self.released.items():
            if self.spec.attack.kind == "next_token":  # a language model: the next tokens against the head's rows
                g = torch.cat([torch.as_tensor(transport.pack(g)) for g, _ in got])
                ids = torch.as_tensor(np.concatenate([y for _, y in got]))
                rows.setdefault(cid, {}).update(next_token_leak(g, ids, torch.as_tensor(self.spec.head_rows)))
                continue
            released = np.concatenate([transport.pack(g).reshape(len(g), -1) for g, _ in got])
            scores = leak_scores(released, np.concatenate([y for _, y in got]), self.spec.num_classes)
            rows.setdefault(cid, {}).update({f"label_{k}": v for k, v in scores.items()})
        self.labels.clear()  # a forward the server withheld never got its middle output
        self.released.clear()


