"""Algorithm base class and registry. Algorithms are written against ``raysplit.runtime.Runtime`` and never
import Ray: they say which hosts run in the actors, which driver runs them, and what happens in a round.

An algorithm steers the experiment through a few overridable hooks with defaults (no boolean flags):

- :meth:`Algorithm.split_model`: where the model is cut (FedAvg keeps the whole model on the clients);
- :meth:`Algorithm.keeps_global_client_model`: whether one global client model exists; when it does not, every
  client's own model persists between rounds (PSL, SGLR, CyclePSL, SplitFedV3);
- :meth:`Algorithm.eval_modes` and :meth:`Algorithm.evaluate`: how the algorithm is evaluated;
- :meth:`Algorithm.setup`, :meth:`Algorithm.resolved`, :meth:`Algorithm.host_setup`, :meth:`Algorithm.positions`;
- :meth:`Algorithm.run_round`: one synchronous round (the :class:`~raysplit.runtime.driver.drivers.RoundDriver` calls
  it); asynchronous algorithms subclass :class:`AsyncAlgorithm` instead (the event driver).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticUndefined

from ..errors import ConfigError
from ..runtime import AsyncRule, Checkpointed, ClientRule, EventDriver, RoundDriver, ServerRule


class AlgorithmParams(BaseModel):
    """Parameters under ``algorithm:`` in a config; each algorithm extends this (unknown keys are errors, every
    field has a description, shown by ``raysplit list``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="the algorithm (raysplit list)")


class CopiesParams(AlgorithmParams):
    """Parameters of the methods that train per-client server copies (PSL, SFLV1 and its variants, SGLR)."""

    batched_copies: bool = Field(
        default=False, description="step the per-client server copies of a pooled step in one batched "
        "computation (torch.func vmap; the same updates up to float rounding). PSL and SFLV1 then serve the "
        "clients' steps interleaved (step 0 of every client, then step 1, ...), which changes the simulated time, "
        "not the models (unless they draw random numbers: dropout); SGLR: its cyclesl variant only")


def clients_per_round(cfg, num_clients: int | None = None) -> int:
    """Clients sampled per round (asynchronous methods: clients active at a time) among ``num_clients`` (default
    ``data.num_clients``), from ``train.participation`` (a count, or a fraction rounded up)."""
    part, n = cfg.train.participation, num_clients or cfg.data.num_clients
    if part.count is not None:
        if part.count > n:
            raise ConfigError(f"train.participation.count={part.count} exceeds data.num_clients={n}")
        return part.count
    return max(1, math.ceil((part.fraction or 1.0) * n))


@dataclass
class SetupInfo:
    """What the driver knows before the run starts (given to ``Algorithm.setup``)."""

    model: Any  # the SplitModel (random init), for resolving further cuts
    cut: int | None  # resolved client/server cut
    counts: np.ndarray  # (clients, labels) train-label counts of the partition
    num_classes: int
    seed: int
    clients_per_round: int = 1  # sampled clients per round (asynchronous: clients active at a time)
    profiles: tuple = ()  # every client's virtual-clock profile
    cuts: tuple | None = None  # each client's own cut (model.tiers, model.cut_budget); None: every client at ``cut``


class Algorithm(Checkpointed):
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams
    client_rule: ClassVar[type] = ClientRule  # what its clients change around a step (runtime/rules.py)
    server_rule: ClassVar[type] = ServerRule  # what its server keeps and does beyond plain steps (runtime/rules.py)
    # why a U-shaped split (model.tail_cut) is refused for it ("" where it runs U-shaped); {name}: the method's
    u_shape: ClassVar[str] = ("a U-shaped split is built for the plain split step of splitnn, psl, sflv1 and sflv2; "
                              "{name} changes its steps in ways it does not cover yet")
    # why a language model (model.lm: its labels are its tokens, no class per sample) is refused ("" where it
    # runs one: the method's steps take the model's loss); {name}: the method's
    language_model: ClassVar[str] = ""
    driver: ClassVar[type] = RoundDriver
    # why clients with their own cuts (model.tiers, model.cut_budget) are refused for it ("" where it takes them); a
    # class's own word only (:meth:`tiers_refused`): a subclass changes its parent's steps, so it says so again
    tiers: ClassVar[str] = ""

    def __init__(self, params: AlgorithmParams, cfg):
        self.params = params
        self.cfg = cfg
        self.local_steps = cfg.train.local_steps
        self.local_epochs = cfg.train.local_epochs
        self.agg = cfg.train.aggregation

    # ---- hooks -----------------------------------------------------------------------------------------------
    def split_model(self, model, cut) -> tuple[int | None, torch.nn.Module, torch.nn.Module]:
        """``(cut index, client part, server part)`` for the configured cut (an index or block name). Default:
        split the model there; a cut the model does not have is a ConfigError listing the valid ones."""
        try:
            index = model.resolve_cut(cut)
        except ValueError as e:
            raise ConfigError(f"model.cut: {e}") from None
        client, server = model.split(index)
        return index, client, server

    @classmethod
    def tiers_refused(cls) -> str:
        """Why this method cannot take clients with their own cuts ('' where it can), by the class's own ``tiers``."""
        why = cls.__dict__.get("tiers")
        if why is None:
            why = ("its steps or models are not built for clients with their own cuts yet (splitnn, psl, sflv1, "
                   "sflv2, sflv3, sflv1_prox, pipar, minibatch_sfl, cyclepsl and cyclesfl are)")
        return why.format(name=cls.name)

    def keeps_global_client_model(self) -> bool:
        """True when the algorithm maintains one global client model (``run_round`` returns a handle to it).
        False: each client keeps its own model across rounds (the hosts persist it per client)."""
        return True

    def eval_modes(self) -> tuple[str, ...]:
        """The ``eval.mode`` values this algorithm supports; the first is what ``auto`` picks. ``global``: the
        global test set; ``clients``: every client's test split through its own client model."""
        return ("global", "clients") if self.keeps_global_client_model() else ("clients",)

    def evaluate(self, rt, mode: str, global_handle, clients: list[int]) -> tuple[np.ndarray, np.ndarray, float]:
        """``(y_true, y_pred, loss_sum)``: default ``global`` = the global client model with the server model,
        ``clients`` = the given clients' test splits through their own models."""
        if mode == "global":
            return rt.evaluate_global(global_handle)
        return rt.evaluate_clients(clients)

    @classmethod
    def check_config(cls, params: AlgorithmParams, cfg) -> None:
        """Combinations of the algorithm's parameters with the rest of the config that cannot work: raise
        ConfigError naming the key. Runs whenever a config is validated (so a sweep refuses a bad trial before
        any trial starts); checks that need the data belong in ``setup``. Default: the server's labelled set
        (``data.n_labeled``) is for the semi-supervised algorithms, which override this."""
        if cfg.data.n_labeled:
            raise ConfigError(f"data.n_labeled={cfg.data.n_labeled} takes labelled samples away from the clients for "
                              f"the server; {cls.name} does not train on them (the semi-supervised algorithms do)")

    def setup(self, info: SetupInfo) -> None:
        """Called on the driver before any actor exists (raise ConfigError for a bad combination)."""

    def resolved(self) -> dict:
        """Values derived at setup worth logging as MLflow params (``resolved.*``)."""
        return {}

    def host_setup(self) -> Any:
        """What the hosts need beyond the validated ``Params``, derived at ``setup``: the rules' ``ctx.setup``."""
        return None

    def finished(self) -> bool:
        """True once the algorithm has nothing left to train (early stopping); the driver stops before
        ``train.rounds``."""
        return False

    def close(self, rt) -> None:
        """After a run that completed, before the runtime stops: release what the run held outside it (Ampere's
        temporary activation store). Not called after a failure, so a resumed run finds what it needs."""

    def state_dict(self) -> dict:
        """The algorithm's own state across rounds on the driver (phases, patience counters), for checkpoints: the
        attributes its classes name in ``checkpointed``."""
        return self.own_state()

    def load_state_dict(self, state: dict) -> None:
        self.load_own_state(state)

    def positions(self) -> list[int] | None:
        """For ordered processing: the label dominant at the clients served at each position of a cycle."""
        return None

    def batches_per_pass(self, n: int, batch_size: int) -> int:
        """Batches in one pass over ``n`` samples: ceil, or floor with ``train.drop_last`` (at least 1), as the
        hosts' data cursor draws them."""
        n = int(n)  # the runtime's sizes are floats
        return max(1, n // batch_size if self.cfg.train.drop_last else math.ceil(n / batch_size))

    def steps_for(self, rt, cid: int) -> int:
        """Batches client ``cid`` runs this round: ``local_steps``, or ``local_epochs`` full passes
        (:meth:`batches_per_pass`)."""
        if self.local_epochs:
            return self.local_epochs * self.batches_per_pass(rt.sizes[cid], self.cfg.train.batch_size)
        return self.local_steps

    def run_round(self, rt, rnd: int, clients: list[int], rng) -> Any:
        """Run one round for the sampled ``clients``. Return a handle to the global client model after the round
        (for evaluation), or None when the algorithm keeps no global client model."""
        raise NotImplementedError

    # ---- shared building steps -------------------------------------------------------------------------------
    def each_client_in_turn(self, rt, clients: list[int], own_server_copy: bool = False) -> None:
        """``steps_for(c)`` split steps for every client, one client's steps consecutively, clients in the given
        order (``rt.split_steps``); ``own_server_copy``: each client trains its own server copy (key = its id)."""
        seq = [c for c in clients for _ in range(self.steps_for(rt, c))]
        rt.split_steps(seq, keys={c: c for c in clients} if own_server_copy else None)

    @classmethod
    def param_docs(cls) -> list[tuple[str, str, str]]:
        """``(key, default, description)`` of every parameter under ``algorithm:`` except ``name``."""
        out = []
        for key, f in cls.Params.model_fields.items():
            if key == "name":
                continue
            default = "required" if f.default is PydanticUndefined else repr(f.default)
            out.append((key, default, f.description or ""))
        return out


class AsyncAlgorithm(Algorithm):
    """An asynchronous method, run by the :class:`~raysplit.runtime.server.async_host.EventDriver`: ``M`` =
    ``train.participation`` clients active at a time, each running ``train.local_steps`` iterations from the latest
    global model before it uploads and a newly sampled client takes its slot; a global round (the MLflow step) ends
    when a new global model exists.

    What happens on the server is its server rule, an :class:`~raysplit.runtime.rules.AsyncRule` (``server_rule``),
    whose hooks the event loop calls in simulated-time order: ``on_arrival`` (an activation arrived; return the
    client's gradient), ``should_flush`` / ``flush`` (after each arrival) and ``on_model_upload`` (a model arrived;
    True when a new global model exists). ``split`` says whether the clients' iterations are split steps (arrival
    events) or local SGD steps."""

    server_rule = AsyncRule
    driver = EventDriver
    split: ClassVar[bool] = True

    def split_model(self, model, cut):
        if not self.split:  # asynchronous FL: the whole model on the clients
            return None, model, torch.nn.Identity()
        return super().split_model(model, cut)

    @classmethod
    def check_config(cls, params, cfg) -> None:
        super().check_config(params, cfg)
        if cfg.train.local_epochs:
            raise ConfigError(f"{cls.name} runs train.local_steps iterations per client job; train.local_epochs is "
                              "not supported")
        n, m, k = cfg.data.num_clients, clients_per_round(cfg), cfg.train.local_steps
        model_buffer = getattr(params, "model_buffer_size", None)
        if model_buffer is not None and model_buffer > n:
            raise ConfigError(f"algorithm.model_buffer_size={model_buffer} exceeds the {n} clients (data.num_clients)")
        buffer = getattr(params, "buffer_size", None)
        if buffer is not None and buffer > m * k:  # an activation buffer in batches, or a buffer of updates
            raise ConfigError(f"algorithm.buffer_size={buffer} exceeds the {m * k} batches the {m} active clients "
                              "send in one job each (train.participation x train.local_steps)")

    def run_round(self, rt, rnd, clients, rng):
        raise TypeError(f"{self.name} is asynchronous: the event driver runs it, not rounds")


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    ALGORITHMS[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm.name {name!r}; registered: {', '.join(sorted(ALGORITHMS))}") from None


def config_error(err: ValidationError, section: str, owner: str, allowed) -> ConfigError:
    """One ConfigError for a section validated by its own model (an algorithm's parameters, a model's or
    dataset's options): each problem named by its dotted key (``section.<key>``), an unknown key with ``owner``
    and what it allows."""
    msgs = []
    for e in err.errors():
        key = f"{section}." + ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            msgs.append(f"unknown key '{key}' for {owner}; allowed: {', '.join(sorted(allowed)) or 'none'}")
        else:
            msgs.append(f"bad value for '{key}': {e['msg']} (got {e.get('input')!r})")
    return ConfigError("invalid config: " + "; ".join(msgs))


def algorithm_params(raw: dict) -> AlgorithmParams:
    cls = get_algorithm(str(raw.get("name")))
    try:
        return cls.Params.model_validate(raw)
    except ValidationError as err:
        raise config_error(err, "algorithm", cls.name, cls.Params.model_fields) from None
