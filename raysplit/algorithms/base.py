"""Algorithm base class and registry. Algorithms are written against ``raysplit.runtime.Runtime`` and never
import Ray: they say which hosts run in the actors and what happens in a round."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..config import ConfigError
from ..runtime import ClientHost, ServerHost


class AlgorithmParams(BaseModel):
    """Parameters under ``algorithm:`` in a config; each algorithm extends this (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")
    name: str


class Algorithm:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams
    client_host: ClassVar[type] = ClientHost
    server_host: ClassVar[type] = ServerHost
    full_model_on_client: ClassVar[bool] = False  # FedAvg: no split
    clients_keep_models: ClassVar[bool] = False  # un-aggregated client models persist per client
    aggregates_clients: ClassVar[bool] = True  # a global client model exists (eval "auto" -> global test set)

    def __init__(self, params: AlgorithmParams, cfg):
        self.p = params
        self.cfg = cfg
        self.local_steps = cfg.train.local_steps
        self.agg = cfg.train.aggregation

    def run_round(self, rt, rnd: int, clients: list[int], rng) -> Any:
        """Run one round for the sampled ``clients``. Return a handle to the global client model after the round
        (for evaluation), or None when the algorithm keeps no global client model."""
        raise NotImplementedError

    def host_extra(self) -> dict:
        """Algorithm parameters the hosts need (shipped in HostSpec.extra)."""
        return {}

    # shared building steps -----------------------------------------------------------------------------------
    def split_steps(self, rt, clients: list[int], server_key=None) -> None:
        """``local_steps`` split steps for every client, client forwards submitted together so they run in
        parallel; the server serves them in the given order (one client's steps consecutively)."""
        keys = {c: c for c in clients} if server_key == "per_client" else None
        rt.split_steps(clients, self.local_steps, keys)


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


Order = Literal["random", "fixed"]
