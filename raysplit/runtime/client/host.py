"""The client host: many virtual clients on one worker (:mod:`raysplit.runtime` says how the rooms fit), an assembly of
components with a declared table of the calls it accepts from other actors (:attr:`ClientHost.CALLS`, plus its
rule's own calls):

- ``data`` (:class:`ClientData`): the hosted clients' samples and data cursors;
- ``meter`` (:class:`CostMeter`): their simulated clocks and counters;
- ``states`` (:class:`ClientStates`): their models and optimizer states;
- ``cut`` (:class:`ClientCut`): the privacy plug-ins at the cut; ``tail`` (:class:`ClientTail`): a U-shaped
  split's tail;
- ``executor`` (:class:`Executor`): runs the clients' computations on the host's device;
- ``slots`` (:class:`ClientSlots`): the round's clients, their update, the dropped ones;
- ``steps`` (:class:`SplitSteps`): the split-learning step; ``pooled`` (:class:`PooledSteps`): several clients' in
  one call, packed where they may be; ``jobs`` (:class:`LocalJobs`): training on their own;
  ``transfers`` (:class:`ModelTransfers`): models in and out; ``moves`` (:class:`Moves`): clients moving and
  checkpoints.

What a method changes around its clients' steps is its client rule (:class:`~raysplit.runtime.rules.ClientRule`),
built from a :class:`~raysplit.runtime.contexts.ClientContext` over these components, whose hooks the components
call in the order given there."""

from __future__ import annotations

import numpy as np
import torch

from raysplit.clock import ClientProfile
from raysplit.runtime import transport
from raysplit.runtime.client.data import ClientData
from raysplit.runtime.client.jobs import LocalJobs
from raysplit.runtime.client.moves import Moves
from raysplit.runtime.client.pooled import PooledSteps
from raysplit.runtime.client.slots import ClientSlots
from raysplit.runtime.client.states import ClientStates
from raysplit.runtime.client.steps import SplitSteps
from raysplit.runtime.client.transfers import ModelTransfers
from raysplit.runtime.contexts import client_context
from raysplit.runtime.client.cut import ClientCut, reconstruction_attack
from raysplit.runtime.evaluation import evaluate_own
from raysplit.runtime.client.executor import Executor
from raysplit.runtime.devices import host_device, limit_threads, set_determinism
from raysplit.runtime.messages import StateMsg
from raysplit.runtime.client.meter import CostMeter
from raysplit.runtime.plan import HostPlan, Progress
from raysplit.runtime.rules import ClientRule, call_table
from raysplit.runtime.client.tail import ClientTail


class ClientHost:
    """Hosts a set of virtual clients on one worker (``data.train_idx``'s keys: those it holds now), computing on
    ``runtime.client.device``, built from a :class:`~raysplit.runtime.plan.HostPlan`. Methods give a client rule
    (``plan.method.client_rule``), made here as ``self.rule``."""

    # what other actors may call: a name, or the component's call it is (a rule adds its own, shadowing none)
    CALLS = {"begin_round": "begin_round", "end_round": "end_round", "evaluate_clients": "evaluate_clients",
             "reconstruction": "reconstruction", "generate": "generate", "forward": "steps.forward",
             "forward_many": "steps.forward_many",
             "forward_clients": "pooled.forward_clients", "backward": "steps.backward",
             "backward_clients": "pooled.backward_clients", "tail_step": "tail.step",
             "local_train": "jobs.local_train", "local_train_many": "jobs.local_train_many", "join": "jobs.join",
             "local_job": "jobs.local_job", "leave": "jobs.leave", "partial_sum": "transfers.partial_sum",
             "set_global": "transfers.install", "get_state": "transfers.send", "load_state": "transfers.receive",
             "export_clients": "moves.export_clients", "import_clients": "moves.import_clients",
             "changed_clients": "moves.changed_clients", "state_dict": "moves.state_dict",
             "load_state_dict": "moves.load_state_dict", "client_totals": "meter.client_totals",
             "pack_counts": "executor.pack_counts"}

    def __init__(self, plan: HostPlan, worker_index: int, data: dict, train_idx: dict[int, np.ndarray],
                 test_idx: dict[int, np.ndarray], profiles: dict[int, ClientProfile], init_state: dict):
        s, rt = plan.sections, plan.sections.runtime
        if rt.torch_threads:
            limit_threads(rt.torch_threads)
        device = host_device(rt.client.device, "runtime.client.device")
        set_determinism(rt.deterministic, device)
        torch.manual_seed(s.seed * 1009 + worker_index)
        self.plan = plan
        self.worker_index = worker_index
        self.progress = Progress()
        self.changed: set[int] = {int(c) for c in train_idx}  # clients changed since the last changed_clients()
        self.data = ClientData(data, train_idx, test_idx, plan.model.inputs, batch_size=s.train.batch_size,
                               seed=s.seed, drop_last=s.train.drop_last, changed=self.changed, device=device)
        self.meter = CostMeter(profiles, self.data.train_idx, charge_server=s.clock.charge_server,
                               changed=self.changed)
        spill = rt.placement
        self.states = ClientStates(lambda: self.rule.build_module(device).to(device),
                                   transport.unpack_state(init_state),
                                   s.train.optimizer, persist=plan.method.persist_client_models, device=device,
                                   state_bytes=int(spill.client_state_mb * 2**20) if spill.client_state_mb else None,
                                   spill_dir=spill.spill_dir, changed=self.changed,
                                   cut_of=plan.model.cut_of if plan.model.cuts is not None else None,
                                   build_cut=lambda cut: plan.model.part_at(cut, device).to(device),
                                   rank_of=plan.model.rank_of if plan.model.ranks is not None else None)
        self.cut = ClientCut(plan.privacy, init_state)
        self.executor = Executor(s.seed, device, rt.pack_clients, plan.model.loss)
        self.tail = (ClientTail(plan.ushape, self.executor, self.states, self.meter, s.train.stop_on_nonfinite)
                     if plan.ushape is not None else None)  # U-shaped: the labels stay here
        rule = lambda: self.rule  # noqa: E731 - the components call the rule made last
        self.slots = ClientSlots(self.data, self.states, self.meter, s.train, self.progress, rule, worker_index)
        self.transfers = ModelTransfers(self.data, self.states, self.meter, self.slots.dropped)
        self.steps = SplitSteps(plan, rule, self.slots, self.data, self.meter, self.states, self.executor,
                                self.cut, self.tail, worker_index)
        self.pooled = PooledSteps(self.steps)
        self.jobs = LocalJobs(plan, self.slots, self.data, self.meter, self.states, self.executor, self.cut,
                              self.transfers, worker_index)
        self.moves = Moves(lambda: (self.data, self.meter, self.states, self.cut, self.jobs), self.steps, self.slots,
                           self.data, self.states, self.executor, self.cut, rule, self.changed, worker_index)
        ctx = client_context(sections=s, model=plan.model, method=plan.method, privacy=plan.privacy,
                             progress=self.progress, data=self.data, meter=self.meter, states=self.states,
                             executor=self.executor, cut=self.cut, activate=self.slots.activate,
                             update=self.slots.update, defend=self.steps.defend)
        self.rule: ClientRule = (plan.method.client_rule or ClientRule)(ctx)
        self.calls = call_table(self, self.rule)

    @property
    def round(self) -> int:
        return self.progress.round

    @property
    def job_round(self) -> dict[int, int]:
        return self.jobs.job_round

    # ---- a round ----------------------------------------------------------------------------------------------
    def begin_round(self, rnd: int, cids: list[int], t0: float) -> None:
        self.progress.round = rnd
        self.slots.dropped.clear()
        self.executor.deferred.clear()
        self.meter.start_round(cids, t0)
        self.data.take_drawn()  # a round redone after a failure counts its samples afresh

    def end_round(self) -> dict[int, dict]:
        """The round's rows per hosted client; first its deferred checks (the gradients' screen and the local
        losses' finite checks, in the order they were made): the one read of the device a round."""
        self.executor.deferred.settle()
        steps, dropped = self.steps, self.slots.dropped
        for tag in [t for t in steps.pending if t.client in dropped]:  # never answered: its tag was forged
            del steps.pending[tag]
            self.cut.take_leak(tag)
        steps.packed.clear()
        if steps.pending:
            raise RuntimeError(f"worker {self.worker_index}: round {self.round} ended with activations that never "
                               f"got a gradient: {sorted(steps.pending)[:5]}")
        for c in list(self.states.slots):
            self.slots.release(c)
        out = self.meter.close_round()
        drawn = self.data.take_drawn()
        for c, row in out.items():
            row.update(self.cut.round_row(c))
            if self.plan.model.language_model:  # the blocks trained on: the round's tokens (raysplit.lm_metrics)
                row["samples"] = drawn.get(c, 0)
            if c in dropped:
                row["drop_reason"] = dropped[c]
        if self.tail is not None:
            self.tail.end_round(out)  # the label attack's scores into the clients' rows
        return out

    # ---- evaluation and the privacy attack -------------------------------------------------------------------
    def evaluate_clients(self, cids: list[int], server_state: StateMsg) -> tuple[np.ndarray, np.ndarray, float]:
        """Each client's own test split through its own client model and the given server model."""
        return evaluate_own(self.plan.parts(self.executor.device), self.data, self.states.state_of, cids,
                            transport.unpack_state(server_state.state), self.plan.sections.eval.batch_size,
                            self.executor.device, client_of=self.plan.model.client_part
                            if self.plan.model.cuts is not None else None, cut_of=self.plan.model.cut_of,
                            language_model=self.plan.model.language_model)

    def generate(self, cid: int, server_state: StateMsg, prompts: list[str], tokenizer, settings: dict,
                 client_state: StateMsg | None = None) -> list[str]:
        """Continuations of ``prompts`` (text) generated by client ``cid`` through the split model
        (:func:`raysplit.lm_metrics.generate_text`): tokenized and decoded here, on the client's side, with the
        run's ``tokenizer``; its client part (``client_state``, the global model, or else its own) before and, in a
        U-shape, after the server part ``server_state``, as evaluation runs them (the server's part computes here,
        as in :meth:`evaluate_clients`: the text never leaves the client's worker, and each part computes exactly
        what it would across the cut). ``settings``: generate_text's keywords (max_new_tokens, greedy,
        temperature, top_k, seed)."""
        from raysplit.lm_metrics import generate_text
        from raysplit.models import UClient

        from raysplit.models.tiers import Entered

        dev, model = self.executor.device, self.plan.model
        client, server = (m.to(dev) for m in model.parts(dev))
        server.load_state_dict(transport.unpack_state(server_state.state))
        if model.cuts is not None:  # tiered: the client's own part, the server entered at its cut
            client, server = model.client_part(cid, dev).to(dev), Entered(server, model.cut_of(cid))
        client.load_state_dict(client_state.tensors() if client_state is not None else self.states.state_of(cid))
        parts = [client.head, server, client.tail] if isinstance(client, UClient) else [client, server]
        return generate_text(parts, tokenizer, prompts, context_length=self.plan.model.input_shape[0],
                             device=self.executor.device, **settings)

    def reconstruction(self, cids: list[int], rnd: int, global_state: StateMsg | None = None) -> dict[int, dict]:
        """``privacy.attack`` against the clients of ``cids`` this host holds (:func:`reconstruction_attack`)."""
        return reconstruction_attack(self.plan.privacy, self.plan.sections.seed, self.data, self.states, self.cut,
                                     self.executor, self.rule, cids, rnd, global_state)
