"""Algorithm base class and registry. Algorithms are written against ``raysplit.runtime.Runtime`` and never
import Ray: they say which hosts run in the actors and what happens in a round."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from pydantic import BaseModel, ConfigDict, ValidationError

from ..config import ConfigError
from ..runtime import ClientHost, ServerHost


class AlgorithmParams(BaseModel):
    """Parameters under ``algorithm:`` in a config; each algorithm extends this (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")
    name: str


@dataclass
class SetupInfo:
    """What the driver knows before the run starts (given to ``Algorithm.setup``)."""

    model: Any  # the SplitModel (random init), for resolving further cuts
    cut: int | None  # resolved client/server cut
    counts: np.ndarray  # (clients, labels) train-label counts of the partition
    num_classes: int
    seed: int


class Algorithm:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams
    client_host: ClassVar[type] = ClientHost
    server_host: ClassVar[type] = ServerHost
    full_model_on_client: ClassVar[bool] = False  # FedAvg: no split
    clients_keep_models: ClassVar[bool] = False  # un-aggregated client models persist per client
    aggregates_clients: ClassVar[bool] = True  # a global client model exists (eval "auto" -> global test set)

    evaluates_itself: ClassVar[bool] = False  # evaluate() computes predictions on the global test set

    def __init__(self, params: AlgorithmParams, cfg):
        self.p = params
        self.cfg = cfg
        self.local_steps = cfg.train.local_steps
        self.local_epochs = cfg.train.local_epochs
        self.agg = cfg.train.aggregation

    def setup(self, info: SetupInfo) -> None:
        """Called on the driver before any actor exists (raise ConfigError for a bad combination)."""

    def resolved(self) -> dict:
        """Values derived at setup worth logging as MLflow params (``resolved.*``)."""
        return {}

    def evaluate(self, rt, global_handle):
        """(y_true, y_pred, loss_sum) on the global test set for algorithms with their own inference rule
        (``evaluates_itself``); the default evaluation is used otherwise."""
        raise NotImplementedError

    def positions(self) -> list[int] | None:
        """For ordered processing: the label dominant at the clients served at each position of a cycle."""
        return None

    def steps_for(self, rt, cid: int) -> int:
        """Batches client ``cid`` runs this round: ``local_steps``, or ``local_epochs`` full passes."""
        if self.local_epochs:
            return self.local_epochs * max(1, math.ceil(rt.sizes[cid] / self.cfg.train.batch_size))
        return self.local_steps

    def run_round(self, rt, rnd: int, clients: list[int], rng) -> Any:
        """Run one round for the sampled ``clients``. Return a handle to the global client model after the round
        (for evaluation), or None when the algorithm keeps no global client model."""
        raise NotImplementedError

    def host_extra(self) -> dict:
        """Algorithm parameters the hosts need (shipped in HostSpec.extra)."""
        return {}

    # shared building steps -----------------------------------------------------------------------------------
    def split_steps(self, rt, clients: list[int], per_client: bool = False) -> None:
        """``steps_for(c)`` split steps for every client, one client's steps consecutively, clients in the
        given order; ``per_client``: each client trains its own server copy (key = client id)."""
        seq = [c for c in clients for _ in range(self.steps_for(rt, c))]
        self.run_sequence(rt, seq, keys={c: c for c in clients} if per_client else None)

    def run_sequence(self, rt, seq: list[int], keys: dict | None = None, method: str = "train_step") -> None:
        """One split step per entry of ``seq`` (client ids), served in that order (``Runtime.split_steps``);
        ``keys[c]`` is the server key client c's steps use (default ``"main"``)."""
        rt.split_steps(seq, keys, method)

ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    ALGORITHMS[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm.name {name!r}; registered: {', '.join(sorted(ALGORITHMS))}") from None


def algorithm_params(raw: dict) -> AlgorithmParams:
    cls = get_algorithm(str(raw.get("name")))
    try:
        return cls.Params.model_validate(raw)
    except ValidationError as err:
        msgs = []
        for e in err.errors():
            key = "algorithm." + ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                msgs.append(f"unknown key '{key}' for {cls.name}; allowed: "
                            f"{', '.join(sorted(f for f in cls.Params.model_fields))}")
            else:
                msgs.append(f"bad value for '{key}': {e['msg']} (got {e.get('input')!r})")
        raise ConfigError("invalid config: " + "; ".join(msgs)) from None


