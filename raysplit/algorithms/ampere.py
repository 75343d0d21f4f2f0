"""Ampere: unidirectional inter-block training (Zhang et al.; ../shared/papers/ampere.txt, Algorithm 1). No public
code exists (seed-code.md §5): this module is our reading of the paper.

1. **Device phase.** The device block (the client part) is trained with a lightweight auxiliary network
   (raysplit/models/auxiliary.py: the server block's first layer at ``ratio`` x its dimension, then a linear
   classifier) and a local cross-entropy loss: FedAvg rounds over the sampled devices of (device block, auxiliary
   net), ``train.local_epochs`` (or ``train.local_steps``) each. No activation or gradient leaves a device. After
   every round the aggregate is validated on every device's validation split (``data.test_fraction``); the phase
   ends when validation accuracy has not improved for ``patience`` rounds, or after ``device_rounds``.
2. **One-shot transfer.** Every device downloads the final device block, computes the activations of its whole
   local set once and sends them in chunks of ``chunk_rows`` (counted as activation bytes and on the virtual
   clock); the server writes them to a disk-backed store (raysplit/data/store.py) at ``store_path`` as they arrive,
   the validation splits' activations to a second store.
3. **Server phase.** The server block is trained from scratch on the consolidated store, one epoch per round with
   a shuffled, memory-bounded loader (``cache_mb``), until validation accuracy (the validation activations) has
   not improved for ``patience`` epochs, or after ``server_epochs``. ``consolidate: false`` is the paper's ablation
   (§5.2.4): a server block per device trained on that device's activations only, averaged after every epoch.
   When the phase stops, the server block of its best validation epoch is restored (``restore_best``, default
   true: early stopping as the paper cites it [40], which keeps the best-validated weights; false keeps the last
   epoch's block, which with patience P is P epochs past the best).

Evaluation on the global test set: the device block with the auxiliary net during the device phase, with the
server block during the server phase. A round is a device round or a server epoch; the run stops when the server
phase does (``train.rounds`` bounds device rounds + server epochs).

Choices: the store's loader overlaps the transfer in simulated time only (the server's first epoch may start when
the first shard has arrived and ends no earlier than the last one's arrival plus its share of the epoch); in wall
time the transfer completes before the first epoch. Shuffling is exact within the shards that fit the cache: with
a cache smaller than the activations, a batch mixes the devices whose chunks share a cache group.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from .base import Algorithm, AlgorithmParams, SetupInfo, register
from ..data.store import ActivationStore, ShuffledLoader, check_space
from ..errors import ConfigError
from ..models.auxiliary import UnsupportedLayer, auxiliary_net
from ..runtime import ClientRule, EvalTally, ServerRule, predict_batches
from ..runtime.messages import StateMsg, Tag


def with_auxiliary(model, device: torch.nn.Module, server: torch.nn.Module, cut, ratio: float) -> torch.nn.Sequential:
    """(device block, auxiliary net) for a split of ``model`` (a ConfigError naming the cut when the generator has
    no rule for the server block's first layer)."""
    dtype = torch.long if model.input_kind == "tokens" else torch.float32
    with torch.no_grad():
        out = device.eval()(torch.zeros(2, *model.input_shape, dtype=dtype))
    device.train()
    try:
        return torch.nn.Sequential(device, auxiliary_net(server, tuple(out.shape[1:]), model.num_classes, ratio))
    except UnsupportedLayer as e:
        raise ConfigError(f"model.cut={cut!r}: {e}") from None


def aux_parts(ctx) -> tuple[torch.nn.Sequential, torch.nn.Module]:
    """(device block + auxiliary net, server block), fresh, of a rule's context (``ctx.model``, at the auxiliary
    net's ``ctx.params.ratio``)."""
    model = ctx.model.build()
    device, server = model.split(ctx.model.cut)
    return with_auxiliary(model, device, server, ctx.model.cut, ctx.params.ratio), server


class AuxRule(ClientRule):
    """A client whose model is (device block, auxiliary net); the device block alone encodes its activations."""

    def build_module(self, device=None) -> torch.nn.Module:
        return aux_parts(self.ctx)[0]

    def encoder(self, tag: Tag, slot):
        return slot.module[0]


class AuxServer(ServerRule):
    """A server whose client models are (device block, auxiliary net): aggregation and evaluation know it."""

    def __init__(self, ctx):
        super().__init__(ctx)
        ctx.evaluation.replace_client(aux_parts(ctx)[0].to(ctx.device))
        ctx.evaluation.client.load_state_dict(ctx.initial_client.tensors())

    def client_encoder(self) -> torch.nn.Module:
        return self.ctx.evaluation.client[0]  # evaluation: the device block with the server block, not the aux net


class AmpereRule(AuxRule):
    """A device: trains (device block, auxiliary net) locally; exports its activations once."""

    _export_model = None  # the global (device block, auxiliary net) of the transfer
    _export_of = None  # the global state it was loaded from

    @torch.no_grad()
    def validate(self) -> tuple[np.ndarray, np.ndarray, float]:
        """The global (device block, auxiliary net) on the validation splits of every device this worker hosts."""
        ctx = self.ctx
        model = aux_parts(ctx)[0]
        model.load_state_dict(ctx.states.global_state)
        model.eval()
        tally = EvalTally()
        for c in sorted(ctx.data.test_idx):
            idx = ctx.data.test_idx[c]
            if len(idx):
                predict_batches(ctx.data.x[idx], ctx.data.y[idx], ctx.model.inputs, ctx.eval.batch_size, model, tally)
        return tally.result()

    @torch.no_grad()
    def export(self, cid: int, split: str, chunk: int, rows: int, t_start: float) -> tuple:
        """Chunk ``chunk`` (``rows`` rows) of the device block's activations of the device's ``split`` (train or
        validation), computed with the global device block, charged (FLOPs, activation bytes) from ``t_start`` on:
        ``(features, labels, device, split, time it reached the server)``."""
        ctx = self.ctx
        if chunk == 0:
            ctx.meter.wait_until(cid, t_start)
        if self._export_of is not ctx.states.global_state:  # the global device block, once per transfer
            self._export_model = aux_parts(ctx)[0].to(ctx.device)
            self._export_model.load_state_dict(ctx.states.global_state)
            self._export_model.eval()
            self._export_of = ctx.states.global_state
        device = self._export_model[0]
        idx = (ctx.data.train_idx if split == "train" else ctx.data.test_idx)[cid][chunk * rows:(chunk + 1) * rows]
        x, y = ctx.data.batch(idx)
        out, fl = ctx.executor.run(("export", tuple(x.shape)), lambda: device(x))
        ctx.meter.charge_compute(cid, fl)
        nbytes = None
        if ctx.cut.defence is not None:  # privacy.defence on the one-shot transfer (each sample released once)
            out, nbytes = ctx.defend(Tag(cid, ctx.round, chunk, f"export_{split}"), x, out,
                                     count=split == "train" and chunk == 0, rate=1.0)
        feats = out.cpu().contiguous().numpy()  # to the server's activation store
        labels = y.cpu().numpy()
        t = ctx.meter.charge_upload(cid, (feats.nbytes if nbytes is None else nbytes) + labels.nbytes, "activations")
        return feats, labels, cid, split, t


class AmpereServer(AuxServer):
    """Holds the consolidated stores and trains the server block on them."""

    checkpointed = ("epochs_done", "arrivals", "server_init", "store_path", "best_val", "best_state", "last_val")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.server_init = copy.deepcopy(ctx.models.main.module.state_dict())
        self.best_val, self.best_state, self.last_val = -1.0, None, float("nan")
        self.stores: dict[str, ActivationStore] = {}
        self.arrivals: list[float] = []
        self.epochs_done, self.store_path = 0, None

    # ---- transfer ----------------------------------------------------------------------------------------------
    def open_stores(self, path: str, expected_bytes: int) -> None:
        try:
            check_space(path, expected_bytes, "algorithm.store_path")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.store_path = path
        self.stores = {s: ActivationStore(Path(path) / s) for s in ("train", "validation")}
        self.arrivals = []

    def ingest(self, chunk: tuple) -> None:
        feats, y, device, split, t = chunk
        self.stores[split].append(feats, y, device)
        self.arrivals.append(t)

    def remove_stores(self) -> None:
        """Delete the activation store (a temporary one, once the run is over)."""
        self.stores = {}
        if getattr(self, "store_path", None):
            shutil.rmtree(self.store_path, ignore_errors=True)

    def seal_stores(self) -> int:
        for s in self.stores.values():
            s.seal()
        return self.stores["train"].rows

    # ---- server phase ---------------------------------------------------------------------------------------------
    def server_epoch(self) -> None:
        """One epoch of the server block on the consolidated activations (or per-device blocks, averaged)."""
        ctx = self.ctx
        p, slot = ctx.params, ctx.models.main
        if self.epochs_done == 0:  # the server block starts from scratch (its initial weights and optimizer)
            slot.module.load_state_dict(self.server_init)
            slot.optimizer = ctx.trainer.optimizer(slot.module.parameters())
            ctx.trainer.wait_until(min(self.arrivals))
        store = self._store("train")
        if p.consolidate:
            self._train(slot, store.shards, "main")
        else:
            sources = sorted({s["source"] for s in store.shards})
            ctx.models.fork(sources)
            for d in sources:
                self._train(ctx.models[d], [s for s in store.shards if s["source"] == d], d)
            rows = {d: sum(s["rows"] for s in store.shards if s["source"] == d) for d in sources}
            ctx.models.merge({d: float(rows[d]) for d in sources})
        if self.epochs_done == 0:  # the first epoch cannot end before the last activations have arrived
            ctx.trainer.wait_until(max(self.arrivals))
        self.epochs_done += 1

    def _train(self, slot, shards: list[dict], key) -> None:
        ctx = self.ctx
        p = ctx.params
        loader = ShuffledLoader(self._store("train"), p.server_batch_size, int(p.cache_mb * 2**20),
                                ctx.seed * 1000 + (0 if key == "main" else int(key) + 1), shards)
        for step, (x, y) in enumerate(loader.epoch(self.epochs_done)):
            xt = torch.from_numpy(np.ascontiguousarray(x)).to(ctx.device)
            ctx.trainer.step(xt, torch.from_numpy(y).to(ctx.device), slot, step=step,
                             where=f"the server phase, epoch {self.epochs_done}, step {step}")
        self.peak_cache = max(getattr(self, "peak_cache", 0), loader.peak_bytes)

    def _store(self, split: str) -> ActivationStore:
        if split not in self.stores:  # after a resume: the sealed store on disk, never a half-written one
            self.stores[split] = ActivationStore.open(Path(self.store_path) / split)
        return self.stores[split]

    @torch.no_grad()
    def validate_server(self) -> float:
        """Accuracy of the server block on the validation activations."""
        store, module = self._store("validation"), self.ctx.models.main.module
        module.eval()
        correct = total = 0
        for x, y in ShuffledLoader(store, 4096, int(self.ctx.params.cache_mb * 2**20), 0).epoch(0):
            pred = module(torch.from_numpy(np.ascontiguousarray(x)).to(self.ctx.device)).argmax(1).cpu().numpy()
            correct += int((pred == y).sum())
            total += len(y)
        module.train()
        acc = self.last_val = correct / max(total, 1)
        if acc > self.best_val:  # the block to restore when the phase stops (Ampere.restore_best)
            self.best_val, self.best_state = acc, copy.deepcopy(module.state_dict())
        return acc

    def restore_best(self) -> None:
        if self.best_state is not None:
            self.ctx.models.main.module.load_state_dict(self.best_state)

    @torch.no_grad()
    def evaluate_phase(self, client_state: StateMsg, phase: str) -> tuple[np.ndarray, np.ndarray, float]:
        """Device block + auxiliary net (device phase) or device block + server block (server phase)."""
        evaluation = self.ctx.evaluation
        if phase != "device":
            return evaluation.evaluate(client_state.tensors(), self.ctx.models.main.module)
        model = evaluation.client
        model.load_state_dict(client_state.tensors())
        model.eval()
        return evaluation.predict(model)

    def round_metrics(self) -> dict:
        out = {"server_epochs": self.epochs_done, "cache_peak_mb": getattr(self, "peak_cache", 0) / 2**20}
        if self.epochs_done:
            out["server_val_accuracy"] = self.last_val  # the epoch's validation accuracy (restore_best picks on it)
        return out

    def restore(self, st: dict) -> None:
        super().restore(st)
        self.stores = {}  # reopened from the restored store_path when first read


class AmpereParams(AlgorithmParams):
    ratio: float = Field(default=0.5, gt=0, le=1, description="auxiliary net's dimension relative to the server "
                         "block's first layer")
    device_rounds: int = Field(default=100, ge=1, description="N_d: most device-phase FedAvg rounds")
    server_epochs: int = Field(default=100, ge=1, description="N_s: most server-phase epochs")
    patience: int = Field(default=15, ge=1, description="rounds/epochs without a better validation accuracy before "
                          "a phase stops (the paper: 15)")
    server_batch_size: int = Field(default=64, ge=1, description="batch of the server phase")
    chunk_rows: int = Field(default=1024, ge=1, description="rows per activation chunk of the one-shot transfer")
    cache_mb: float = Field(default=512.0, gt=0, description="most MB of activations the server's loader holds")
    store_path: str | None = Field(default=None, description="folder of the activation store (default: a folder in "
                                   "the system temp directory)")
    consolidate: bool = Field(default=True, description="false: the ablation with a server block per device, "
                              "averaged every epoch")
    restore_best: bool = Field(default=True, description="when the server phase stops, restore its best-validated "
                               "server block (false: keep the last epoch's)")


@register
class Ampere(Algorithm):
    """Ampere (module docstring): device phase with an auxiliary net, one-shot activation transfer into a
    disk-backed store, server phase on the consolidated activations."""

    name = "ampere"
    tiers = ("its device phase trains each device's block with an auxiliary head built for the one cut's "
             "activation shape (FedAvg of one shape) and its server phase trains on the consolidated activations "
             "of that shape from one store; device blocks of other depths need an auxiliary head and an "
             "activation store per depth and a server phase entering at each: not built")
    u_shape = "{name}'s server phase trains on the devices' exported activations with their labels"
    language_model = ("{name}'s device phase trains a classifier head (its auxiliary network, built from the class "
                      "logits' layer) and stops on validation accuracy over class labels")
    description = "Ampere: device block + auxiliary net to convergence, one-shot activations, server block after"
    Params = AmpereParams
    client_rule = AmpereRule
    server_rule = AmpereServer
    checkpointed = ("phase", "round_phase", "best", "bad", "done", "device_rounds", "server_epochs", "store_path")

    @classmethod
    def check_config(cls, params, cfg) -> None:
        super().check_config(params, cfg)
        if cfg.data.test_fraction <= 0:
            raise ConfigError("ampere stops its phases on validation accuracy: set data.test_fraction > 0 (each "
                              "device's validation split)")

    def split_model(self, model, cut):
        """The client part is (device block, auxiliary net)."""
        index, device, server = super().split_model(model, cut)
        client = with_auxiliary(model, device, server, cut, self.params.ratio)
        dtype = torch.long if model.input_kind == "tokens" else torch.float32
        with torch.no_grad():
            out = device.eval()(torch.zeros(1, *model.input_shape, dtype=dtype))
        device.train()
        self.activation_row_bytes = int(np.prod(out.shape[1:])) * out.element_size() + 8  # features + label
        return index, client, server

    def setup(self, info: SetupInfo) -> None:
        p = self.params
        self.phase, self.best, self.bad, self.done, self.device_rounds, self.server_epochs = "device", -1.0, 0, False, 0, 0
        self.round_phase = self.phase  # state_dict is taken before the first round too (runtime.faults.max_retries)
        shards = sum(math.ceil(n / p.chunk_rows) for n in info.counts.sum(axis=1))
        need = 2 * shards * self.activation_row_bytes  # the loader holds two groups, each a row of every shard
        if p.cache_mb * 2**20 < need:
            raise ConfigError(f"algorithm.cache_mb={p.cache_mb} is too small for the {shards} shards of the store "
                              f"(at least {need / 2**20:.2f} MB; or raise algorithm.chunk_rows)")
        rows = int(info.counts.sum()) / (1 - self.cfg.data.test_fraction)  # with the validation splits, about
        self.store_path = p.store_path or tempfile.mkdtemp(prefix="raysplit-ampere-")  # a temporary one: close()
        try:
            check_space(self.store_path, int(rows * self.activation_row_bytes), "algorithm.store_path")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def resolved(self) -> dict:
        return {"ampere.store_path": self.store_path}

    def _improved(self, acc: float) -> bool:
        """Track the best validation accuracy; True when the phase should go on."""
        if acc > self.best:
            self.best, self.bad = acc, 0
        else:
            self.bad += 1
        return self.bad < self.params.patience

    def run_round(self, rt, rnd, clients, rng):
        p = self.params
        self.round_phase = self.phase  # what this round trained (and is evaluated on)
        if self.phase == "device":
            rt.workers.local_train_many({int(c): self.steps_for(rt, c) for c in clients})  # packed where it pays
            agg = rt.aggregate_clients(rt.weights(clients, self.agg.weights), self.agg.write_to)
            self.device_rounds += 1
            parts = rt.get(rt.workers.validate())
            y, pred = np.concatenate([q[0] for q in parts]), np.concatenate([q[1] for q in parts])
            self.val_accuracy = float((y == pred).mean()) if len(y) else 0.0
            if not self._improved(self.val_accuracy) or self.device_rounds >= p.device_rounds:
                self._transfer(rt, agg)
                self.phase, self.best, self.bad = "server", -1.0, 0
            return agg
        rt.server.server_epoch()
        self.server_epochs += 1
        self.val_accuracy = rt.get(rt.server.validate_server())
        if not self._improved(self.val_accuracy) or self.server_epochs >= p.server_epochs:
            self.done = True
            if p.restore_best:
                rt.get(rt.server.restore_best())  # before this round's evaluation
        return None

    def _transfer(self, rt, agg) -> None:
        """Every device downloads the final device block and sends the activations of its data once."""
        p = self.params
        everyone = list(range(rt.num_clients))
        rt.install(agg, receivers=everyone)
        rows = sum(len(i) for i in rt.inputs.train_idx) + sum(len(i) for i in rt.inputs.test_idx)
        rt.get(rt.server.open_stores(self.store_path, int(1.1 * self.activation_row_bytes * rows)))
        t_start = rt.get(agg).t_sent
        pending = []
        for c in everyone:
            for split, n in (("train", len(rt.inputs.train_idx[c])), ("validation", len(rt.inputs.test_idx[c]))):
                for k in range(math.ceil(n / p.chunk_rows)):
                    pending.append(rt.server.ingest(rt.client(c).export(split, k, p.chunk_rows, t_start)))
                    if len(pending) >= 16:  # bound the chunks in flight
                        rt.get(pending)
                        pending = []
        rt.get(pending)
        rt.get(rt.server.seal_stores())

    def finished(self) -> bool:
        return self.done

    def close(self, rt) -> None:
        """A temporary store (no ``store_path`` given) is deleted where the server wrote it, and on the driver."""
        if self.params.store_path is None:
            rt.get(rt.server.remove_stores())
            shutil.rmtree(self.store_path, ignore_errors=True)

    def eval_modes(self) -> tuple[str, ...]:
        return ("global",)

    def evaluate(self, rt, mode, global_handle, clients):
        return rt.get(rt.server.evaluate_phase(global_handle, self.round_phase))

    def load_state_dict(self, state: dict) -> None:
        made = self.store_path if self.params.store_path is None else None  # setup's fresh temporary folder
        super().load_state_dict(state)
        if made and made != self.store_path:  # the checkpoint's store is the one to use
            shutil.rmtree(made, ignore_errors=True)
