"""The client host: many virtual clients on one worker (see :mod:`raysplit.runtime.hosts`), assembled from its
components: the clients' data and cursors (:class:`ClientData`), the cost meter (:class:`CostMeter`), the
client-state store (:class:`ClientStates`), the privacy plug-ins at the cut (:class:`ClientCut`) and the executor
that runs the clients' computations (:class:`Executor`). The host holds the split-learning step (a forward whose
graph waits here for its gradient, the backward, the client's update); what a method changes around it is its
client rule (:class:`~raysplit.runtime.rules.ClientRule`), whose hooks the host calls in the order given there;
the step itself is :class:`~raysplit.runtime.client_steps.ClientSteps`."""

from __future__ import annotations

import numpy as np
import torch

from raysplit.clock import ClientProfile
from raysplit.runtime import transport
from raysplit.runtime.client_data import ClientData
from raysplit.runtime.client_jobs import ClientJobs
from raysplit.runtime.client_moves import ClientMoves
from raysplit.runtime.client_states import ClientStates
from raysplit.runtime.client_steps import ClientSteps
from raysplit.runtime.client_transfers import ModelTransfers
from raysplit.runtime.cut import ClientCut, CutCalls
from raysplit.runtime.evaluation import evaluate_own
from raysplit.runtime.executor import Executor
from raysplit.runtime.hostspec import HostSpec, ModelSlot, build_parts, host_device, limit_threads, set_determinism
from raysplit.runtime.messages import StateMsg, Tag
from raysplit.runtime.meter import CostMeter
from raysplit.runtime.optim import round_lr
from raysplit.runtime.rules import ClientRule
from raysplit.runtime.ushape import ClientTail, TailCalls


class ClientHost(ClientSteps, ClientJobs, ClientMoves, CutCalls, TailCalls):
    """Hosts a set of virtual clients on one worker (``data.train_idx``'s keys: those it holds now), computing on
    ``runtime.client.device``. Methods give a client rule (``spec.client_rule``), made here as ``self.rule``."""

    # the host's own per-client mappings that move with a client (``export_clients``; its components' move too)
    client_fields: tuple[str, ...] = ("job_round", "job_loss")

    def __init__(self, spec: HostSpec, worker_index: int, data: dict, train_idx: dict[int, np.ndarray],
                 test_idx: dict[int, np.ndarray], profiles: dict[int, ClientProfile], init_state: dict):
        if spec.torch_threads:
            limit_threads(spec.torch_threads)
        device = host_device(spec.client_device, "runtime.client.device")
        set_determinism(spec.deterministic, device)
        torch.manual_seed(spec.seed * 1009 + worker_index)
        self.spec = spec
        self.params = spec.params
        self.worker_index = worker_index
        self.changed: set[int] = {int(c) for c in train_idx}  # clients changed since the last changed_clients()
        self.data = ClientData(data, train_idx, test_idx, spec.data_spec, batch_size=spec.batch_size,
                               seed=spec.seed, drop_last=spec.drop_last, changed=self.changed, device=device)
        self.meter = CostMeter(profiles, self.data.train_idx, charge_server=spec.charge_server, changed=self.changed)
        self.states = ClientStates(lambda: self.rule.build_module().to(device), transport.unpack_state(init_state),
                                   spec.client_optimizer, persist=spec.persist_client_models, device=device,
                                   state_bytes=spec.client_state_bytes, spill_dir=spec.spill_dir, changed=self.changed)
        self.cut = ClientCut(spec.privacy)
        self.tail = ClientTail(self, spec.ushape) if spec.ushape is not None else None  # U-shaped: labels stay here
        self.executor = Executor(spec.seed, device, spec.pack_clients)
        self.dropped: dict[int, str] = {}  # clients dropped this round (job, under events) and why (on_bad_client)
        self.transfers = ModelTransfers(self.data, self.states, self.meter, self.dropped)
        self.pending: dict[Tag, torch.Tensor] = {}  # forwards awaiting their gradient
        self._replay: dict[Tag, tuple[np.ndarray, dict]] = {}  # event driver: what rebuilds a pending forward
        self.packed: dict[Tag, tuple] = {}  # packed forwards awaiting their gradient: (Packed, index in it)
        self.round = -1
        self.job_round: dict[int, int] = {}  # event driver: the global round each active client's job began in
        self.job_loss: dict[int, float] = {}  # event driver: mean loss of a local job, sent with the model
        self.rule: ClientRule = (spec.client_rule or ClientRule)(self)

    # ---- a client's round ----------------------------------------------------------------------------------------
    def activate(self, cid: int, state: dict | None = None, rnd: int | None = None) -> ModelSlot:
        """The client's slot for this round: its own model (or the global one, or ``state``), its optimizer with
        the per-client state restored and the learning rate of round ``rnd`` (default: the host's round)."""
        if cid in self.states.slots:
            return self.states.slots[cid]
        if cid not in self.data:
            raise KeyError(f"client {cid} is not hosted by worker {self.worker_index}")
        lr = round_lr(self.spec.client_optimizer, self.round if rnd is None else rnd, self.spec.rounds)
        slot = self.states.activate(cid, lr, state)
        self.rule.on_activate(cid, slot)
        return slot

    def release(self, cid: int, keep_weights: bool | None = None) -> None:
        """The client's round is over: its weights and optimizer state kept (a dropped client keeps what it had
        before the round), then the rule's ``on_release``."""
        self.states.release(cid, keep_weights, keep_state=cid not in self.dropped)
        self.rule.on_release(cid)

    def begin_round(self, rnd: int, cids: list[int], t0: float) -> None:
        self.round = rnd
        self.dropped.clear()
        self.meter.start_round(cids, t0)

    def clip_grads(self, module: torch.nn.Module) -> None:
        if self.spec.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.spec.clip_grad_norm)

    def _update(self, cid: int, slot: ModelSlot) -> None:
        """The client's update once its gradients are in: the rule's ``before_step``, clipping
        (``train.clip_grad_norm``: it sees the whole gradient), the optimizer's step."""
        self.rule.before_step(cid, slot)
        self.clip_grads(slot.module)
        slot.optimizer.step()

    def drop(self, cid: int, why: str) -> None:
        """Client ``cid`` takes no further part in this round (job): no more updates, left out of aggregation, its
        own model and optimizer state stay as they were before the round (``runtime.faults.on_bad_client: drop``)."""
        if cid not in self.dropped:
            self.dropped[cid] = why
            self.meter.count(cid, dropped=1)

    # ---- model transfers (ModelTransfers) and evaluation ------------------------------------------------------
    def partial_sum(self, weights: dict[int, float]) -> StateMsg | None:
        """FedAvg's weighted sum of the hosted clients' weights (upload counted per client)."""
        return self.transfers.partial_sum(weights)

    def set_global(self, msg: StateMsg, receivers: list[int] | None = None, only: list[int] | None = None) -> None:
        """An aggregate installed for all clients, or as the own model of those in ``only``."""
        self.transfers.install(msg, receivers, only)

    def get_state(self, cid: int) -> StateMsg:
        """Client ``cid`` sends its current model."""
        return self.transfers.send(cid)

    def load_state(self, cid: int, msg: StateMsg) -> None:
        """Client ``cid`` receives a model as its own (a hand-over)."""
        self.transfers.receive(cid, msg)

    def end_round(self) -> dict[int, dict]:
        for tag in [t for t in self.pending if t.client in self.dropped]:  # never answered: its tag was forged
            del self.pending[tag]
            self.cut.take_leak(tag)
        self.packed.clear()
        if self.pending:
            raise RuntimeError(f"worker {self.worker_index}: round {self.round} ended with activations that never "
                               f"got a gradient: {sorted(self.pending)[:5]}")
        for c in list(self.states.slots):
            self.release(c)
        out = self.meter.close_round()
        for c, row in out.items():
            row.update(self.cut.round_row(c))
            if c in self.dropped:
                row["drop_reason"] = self.dropped[c]
        if self.tail is not None:
            self.tail.end_round(out)  # the label attack's scores into the clients' rows
        return out

    def evaluate_clients(self, cids: list[int], server_state: StateMsg) -> tuple[np.ndarray, np.ndarray, float]:
        """Each client's own test split through its own client model and the given server model."""
        return evaluate_own(build_parts(self.spec), self.data, self.states.state_of, cids,
                            transport.unpack_state(server_state.state), self.spec, self.executor.device)
