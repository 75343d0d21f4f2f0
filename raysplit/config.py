"""Experiment configuration: YAML validated into typed pydantic models.

Every section forbids unknown keys, so a typo is one error naming the dotted key and what is allowed. Dotted
``key=value`` overrides (CLI, sweeps) go through :func:`apply_overrides` before validation, so they are checked
exactly like the file. Algorithm-specific parameters are validated by the parameter model the algorithm registers
(``raysplit.algorithms``), after the generic schema.
"""

from __future__ import annotations

import copy
import functools
import inspect
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, create_model,
                      field_validator, model_validator)

from raysplit.algorithms import AlgorithmParams, algorithm_params, get_algorithm
from raysplit.algorithms.base import config_error
from raysplit.clock import ClockConfig, HomogeneousClock
from raysplit.data.partition import DirichletPartition, PartitionConfig
from raysplit.data.text import TextConfig
from raysplit.errors import ConfigError
from raysplit.label_privacy import LabelAttackConfig, LabelDefenceConfig, NoLabelAttack, NoLabelDefence
from raysplit.models.causal_lm import LMConfig
from raysplit.privacy import AttackConfig, DefenceConfig, NoAttack, NoDefence

__all__ = ["ConfigError", "ExperimentConfig", "apply_overrides", "dump", "flatten", "load_config", "validate"]


@functools.cache  # one model per builder or loader, not one per config read (Tune validates every trial)
def options_model(fn: Any, label: str) -> type[BaseModel]:
    """A pydantic model of ``fn``'s keyword arguments (a model builder's or a dataset loader's), from its signature:
    each argument's annotation and default; unknown keys forbidden unless ``fn`` takes ``**kwargs``. The sizes the
    caller passes (``num_classes``, ``input_shape``, ``root``) are not options."""
    hints = typing.get_type_hints(fn)
    fields: dict[str, Any] = {}
    extra = "forbid"
    for name, prm in inspect.signature(fn).parameters.items():
        if prm.kind is inspect.Parameter.VAR_KEYWORD:
            extra = "allow"
        if name in ("num_classes", "input_shape", "root") or prm.kind in (inspect.Parameter.VAR_POSITIONAL,
                                                                          inspect.Parameter.VAR_KEYWORD):
            continue
        fields[name] = (hints.get(name, Any), ... if prm.default is inspect.Parameter.empty else prm.default)
    return create_model(f"{label} options", __config__=ConfigDict(extra=extra, arbitrary_types_allowed=True),
                        **fields)


def _checked_options(data: Any, section: str, registry: dict, builder_of) -> Any:
    """``data`` (a raw model or data section) with its ``options`` validated by the named entry's own signature
    (:func:`options_model`): one ConfigError naming ``section.options.<key>`` and what is allowed. A name not
    registered (yet) is left for the loader's own error."""
    if not isinstance(data, dict) or not data.get("options"):
        return data
    name = str(data.get("name", data.get("dataset", "")))
    key = name.strip().lower().replace("-", "_") if section == "data" else name
    if key not in registry:
        return data
    kind = "dataset" if section == "data" else section
    model = options_model(builder_of(registry[key]), f"{kind} {name}")
    try:
        checked = model.model_validate(data["options"])
    except ValidationError as err:
        raise config_error(err, f"{section}.options", f"{kind} {name!r}", model.model_fields) from None
    given = set(data["options"])
    return {**data, "options": {k: v for k, v in checked.model_dump().items() if k in given}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Strict):
    dataset: str = Field(default="fashion_mnist", description="a dataset raysplit loads (listed by "
                         "`raysplit list`): fashion_mnist, digits, cifar10, ...")
    root: str | None = Field(default=None, description="directory holding the dataset's files (null: the "
                             "loader's search path, e.g. the Debian package's copy); a given root that lacks "
                             "them is an error")
    num_clients: int = Field(default=20, ge=1, description="virtual clients the training set is split over")
    partition: PartitionConfig = Field(default=DirichletPartition(), description="how the training set is split "
                                       "over the clients: name picks the partitioner, the other keys are its own "
                                       "parameters")
    test_fraction: float = Field(default=0.1, ge=0, lt=1, description="per-client sample-wise test split")
    max_train_samples: int | None = Field(default=None, ge=1, description="subsample the train set (quick runs)")
    max_test_samples: int | None = Field(default=None, ge=1, description="subsample the global test set (quick "
                                         "runs)")
    n_labeled: int = Field(default=0, ge=0, description="class-balanced labelled samples taken out of the training "
                           "set for the server (semi-supervised methods); the rest goes to the clients")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the dataset's loader "
                                    "(e.g. label: coarse), checked against its signature (docs/config.md lists "
                                    "them)")
    text: TextConfig | None = Field(default=None, description="text for a language model (model.lm): corpus, "
                                    "tokenizer, context length; data.partition's natural is by source; set "
                                    "with model.lm (data.dataset is then unused)")

    @model_validator(mode="before")
    @classmethod
    def _typed_options(cls, data: Any) -> Any:
        from raysplit.data import DATASETS

        return _checked_options(data, "data", DATASETS, lambda loader: loader)

    @field_validator("partition", mode="before")
    @classmethod
    def _default_partitioner(cls, v):
        """A partition section without ``name`` is the default partitioner's (dirichlet), as before the sections
        were typed: ``data.partition.alpha=0.1`` alone still works."""
        if isinstance(v, dict) and "name" not in v:
            return {"name": cls.model_fields["partition"].default.name, **v}
        return v


class TierConfig(_Strict):
    cut: int | str = Field(description="the cut of this tier's clients: a block name or index (blocks before it run "
                           "on them)")
    clients: list[int] | None = Field(default=None, description="the client ids of this tier (or share)")
    share: float | None = Field(default=None, gt=0, le=1, description="the share of the clients in this tier (or "
                                "clients); which clients: model.tier_order")
    rank: int | None = Field(default=None, gt=0, description="a language model's LoRA rank on this tier's clients "
                             "(null: model.lm.adapter.rank); adapters of different ranks aggregate zero-padded, "
                             "each rank component over its holders (raysplit/runtime/tiered.py)")

    @model_validator(mode="after")
    def _one_way(self):
        if (self.clients is None) == (self.share is None):
            raise ValueError("a tier names its clients or its share of them, one of the two")
        return self


class CutBudgetConfig(_Strict):
    seconds: float = Field(gt=0, description="the compute budget: the simulated seconds one batch "
                           "(train.batch_size) of forward and backward through a client's blocks may take at its "
                           "clock profile's FLOP/s; each client gets the deepest cut within it")
    cuts: list[int | str] | None = Field(default=None, description="the cuts to choose from (null: every cut of the "
                                         "model); a client that affords none gets the shallowest")


class ModelConfig(_Strict):
    name: str = Field(default="cnn_small", description="a model of raysplit/models (listed by `raysplit list`)")
    cut: int | str | None = Field(default=None, description="where the model is split: a block name or index "
                                  "(null: the model's default cut); blocks before it run on the clients")
    tail_cut: int | str | None = Field(default=None, description="a U-shaped split (null: none): the blocks after "
                                       "this one (a block name or index, after cut) run on the clients too, with "
                                       "the loss; the server trains the blocks between and never sees a label "
                                       "(splitnn, psl, sflv1, sflv2, sflv3, splitlora)")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the model's builder "
                                    "(e.g. cifar_stem), checked against its signature (docs/config.md lists them)")
    tiers: list[TierConfig] | None = Field(default=None, description="clients with their own cuts (null: every "
                                           "client at model.cut): a list of {cut, clients} or {cut, share}; the "
                                           "server holds the blocks from the shallowest cut on (docs/usage.md)")
    tier_order: Literal["ids", "seeded", "speed"] = Field(default="ids", description="with shares: which clients "
                                                           "go to which tier: by ascending id in the tiers' order "
                                                           "(ids), in a seeded permutation (seeded), or the fastest "
                                                           "clients (clock profile FLOP/s) to the deepest cuts (speed)")
    cut_budget: CutBudgetConfig | None = Field(default=None, description="instead of tiers: each client gets the "
                                               "deepest cut its clock profile affords under a compute budget")
    lm: LMConfig | None = Field(default=None, description="a decoder language model from transformers (gpt2, "
                                "llama), random or from a local directory, with its adapters; trains on data.text "
                                "(model.name is then unused; every method but those that need a class label per "
                                "sample: docs/usage.md)")

    @model_validator(mode="before")
    @classmethod
    def _typed_options(cls, data: Any) -> Any:
        from raysplit.models import MODELS

        return _checked_options(data, "model", MODELS, lambda info: info.builder)

    @model_validator(mode="after")
    def _tiers(self):
        given = [k for k in ("tiers", "cut_budget") if getattr(self, k) is not None]
        if len(given) == 2:
            raise ValueError("give model.tiers or model.cut_budget, not both")
        if given and self.cut is not None:
            raise ValueError(f"model.{given[0]} gives every client its cut; model.cut must then be left out")
        tiers = self.tiers or []
        if self.tiers is not None and not tiers:
            raise ValueError("model.tiers is empty: give at least one tier (or leave it out)")
        if any(t.share is not None for t in tiers) and any(t.clients is not None for t in tiers):
            raise ValueError("model.tiers: give every tier its clients or every tier its share, not a mix")
        if tiers and tiers[0].share is not None and abs(sum(t.share for t in tiers) - 1.0) > 1e-9:
            raise ValueError(f"model.tiers: the shares sum to {sum(t.share for t in tiers):g}, not 1")
        return self


class OptimizerConfig(_Strict):
    name: Literal["sgd", "adam", "adamw"] = Field(default="sgd", description="the torch optimizer")
    lr: float = Field(default=0.05, gt=0, description="learning rate of round 0")
    momentum: float = Field(default=0.0, ge=0, lt=1, description="sgd: momentum")
    weight_decay: float = Field(default=0.0, ge=0, description="L2 weight decay")
    nesterov: bool = Field(default=False, description="sgd: Nesterov momentum")
    decay: float = Field(default=1.0, gt=0, le=1, description="per-round lr factor: lr_r = max(lr*decay^r, min_lr)")
    min_lr: float = Field(default=0.0, ge=0, description="the learning rate's floor (decay) or end (cosine)")
    schedule: Literal["exponential", "cosine"] = Field(default="exponential", description="per-round lr: "
                                                       "exponential (decay) or cosine from lr to min_lr over the rounds")


class ParticipationConfig(_Strict):
    fraction: float | None = Field(default=1.0, gt=0, le=1, description="share of the clients sampled each "
                                   "round")
    count: int | None = Field(default=None, ge=1, description="clients sampled each round (instead of "
                              "fraction)")

    @model_validator(mode="after")
    def _one(self):
        if self.count is not None and self.fraction not in (None, 1.0):
            raise ValueError("give participation.fraction or participation.count, not both")
        return self


class AggregationConfig(_Strict):
    weights: Literal["samples", "uniform"] = Field(default="samples", description="FedAvg weights: by client "
                                                   "sample count or equal")
    write_to: Literal["all", "sampled"] = Field(default="all", description="who receives the aggregate: every "
                                                "client or only the round's sampled ones")


class TrainConfig(_Strict):
    rounds: int = Field(default=50, ge=1, description="global rounds")
    batch_size: int = Field(default=32, ge=1, description="samples per client batch")
    local_steps: int = Field(default=1, ge=1, description="batches per sampled client per round")
    local_epochs: int | None = Field(default=None, ge=1, description="if set: full passes over its data per "
                                     "sampled client per round (ceil(n/batch_size) batches each; replaces "
                                     "local_steps), as in Hydra's code")
    drop_last: bool = Field(default=False, description="a client's last short batch of each pass over its data is "
                            "skipped (PyTorch's DataLoader drop_last, as in Hydra's code): local_epochs then gives "
                            "floor(n/batch_size) batches a pass instead of ceil; a client with fewer than batch_size "
                            "samples still runs its one short batch")
    optimizer: OptimizerConfig = Field(default=OptimizerConfig(), description="the clients' optimizer (and the "
                                       "server's unless server_optimizer is given)")
    server_optimizer: OptimizerConfig | None = Field(default=None, description="the server's optimizer (null: "
                                                     "the same as optimizer)")
    participation: ParticipationConfig = Field(default=ParticipationConfig(), description="which clients take "
                                               "part in a round")
    aggregation: AggregationConfig = Field(default=AggregationConfig(), description="FedAvg of the client "
                                           "parts")
    stop_on_nonfinite: bool = Field(default=True, description="a NaN or inf loss stops the run naming round and "
                                    "client (false: the run goes on)")
    clip_grad_norm: float | None = Field(default=None, gt=0, description="clip every client and server step's "
                                         "gradient norm (GAS's code: 10)")


class EvalConfig(_Strict):
    every: int = Field(default=1, ge=1, description="evaluate every N rounds (and after the last)")
    mode: Literal["auto", "global", "clients"] = Field(default="auto", description="global: the global test set "
                                                       "through the global model; clients: each client's test "
                                                       "split through its own model; auto: the algorithm's first "
                                                       "mode")
    clients: Literal["sampled", "all"] = Field(default="sampled", description="whose test splits mode=clients uses")
    batch_size: int = Field(default=1000, ge=1, description="evaluation batch size")
    target_accuracy: float | None = Field(default=None, gt=0, le=1, description="log the first round at which "
                                          "accuracy reaches it (eval/rounds_to_target)")
    validation: bool = Field(default=False, description="beside the global test set, evaluate every client's "
                             "held-out split (data.test_fraction) as a validation set at each evaluation, as "
                             "eval.mode=clients would (each client's current model: the aggregate where the "
                             "round installs it on every client, as SplitFed does): eval/validation_accuracy and "
                             "eval/validation_loss (a language model: eval/validation_perplexity), and at the end "
                             "the test metric of the best-validated evaluation (summary/best_validation_round, "
                             "counted from 0 as every round is, summary/accuracy_at_best_validation or "
                             "summary/perplexity_at_best_validation): "
                             "model selection on validation, as early stopping with a restored best would give. "
                             "Needs eval.mode=global")


class ActorResources(_Strict):
    num_cpus: float = Field(default=0.0, ge=0, description="logical CPUs the actor holds")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs the actor holds (a fraction: actors share one, "
                            "e.g. 0.25: four client actors to a GPU)")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="where the actor's host computes "
                                                   "(its model, optimizer state, data and evaluation): auto: a GPU "
                                                   "where the host sees one (under Ray an actor sees one only where "
                                                   "it holds num_gpus; the local backend: the process's), else the "
                                                   "CPU; cuda: an error where there is none")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources the actor "
                                        "needs (pins it to nodes offering them)")
    memory: int | None = Field(default=None, ge=0, description="bytes")


class FaultInjection(_Strict):
    """A deliberate actor death, for fault tests and chaos runs (``make fault-matrix``, ``make chaos``): the named
    actor kills its own process (SIGKILL, as the kernel's OOM killer or a crashed node would) when it enters its
    ``call``-th host method call (of ``method``, if given) from round ``round`` on; only the run's first actors do,
    not their replacements."""

    actor: str = Field(pattern=r"^(server|client[0-9]+)$", description="'server' or 'clientI' (client actor I)")
    round: int = Field(default=0, ge=0, description="the round (counted from 0) from which calls are counted")
    call: int = Field(default=1, ge=1, description="it dies entering its Nth counted host method call")
    method: str | None = Field(default=None, description="count only calls of this host method (e.g. 'ingest', "
                               "'step'); null: every public method")


class PlacementConfig(_Strict):
    """Where the virtual clients live: which client actor serves a client, and where their state is kept."""

    strategy: Literal["balanced", "home"] = Field(
        default="balanced", description="balanced: each round's clients spread evenly over the client actors "
        "(each gets its share +-1; a client's state moves with it); home: client c always on actor c mod "
        "num_workers")
    spread_clients: bool = Field(default=False, description="Ray: SPREAD the client actors over the nodes")
    client_state_mb: float | None = Field(default=None, gt=0, description="per client actor, MB of per-client "
                                          "model and optimizer state kept in memory; the least recently used "
                                          "beyond it spill to disk (null: all in memory)")
    spill_dir: str | None = Field(default=None, description="where spilled client state goes (null: the system's "
                                  "temporary directory, on the actor's node)")


class TransportConfig(_Strict):
    """How a round's split steps travel between the hosts."""

    kind: Literal["auto", "compiled", "calls", "rdt"] = Field(
        default="auto", description="Ray, with direct_steps: how the server actor reaches the client actors "
        "in a driven loop: Ray Compiled Graphs (shared-memory channels, one graph per client actor, compiled once "
        "per run) or ordinary actor calls; identical results. auto: compiled where the cluster has a CPU core for "
        "every actor and the driver (a compiled graph's idle actors poll their channels); with fewer, compiled "
        "for the split- and pooled-step loops and calls for the event loop (compiled-steps); logged as the param "
        "resolved.transport. rdt (a prototype, needs "
        "direct_steps: false): activations and gradients travel actor to actor by Ray Direct Transport over gloo "
        "instead of the object store")
    direct_steps: bool = Field(default=True, description="Ray: the server actor drives a round's split steps, "
                               "calling client actors directly (false: the driver chains every call)")

    @model_validator(mode="after")
    def _rdt_is_driver_chained(self):
        if self.kind == "rdt" and self.direct_steps:
            raise ValueError("runtime.transport.kind=rdt needs runtime.transport.direct_steps=false: Ray 2.60's gloo "
                             "transport is two-sided, an object reaches only a task that takes it as an argument "
                             "(ray.get on it is refused), so the server cannot pull activations inside a loop it "
                             "drives; the driver chains the calls instead")
        return self
    max_in_flight: int = Field(default=256, ge=2, description="split steps submitted ahead of their completion")
    window: int | None = Field(default=4, ge=1, description="forwards submitted ahead per client actor in a round's "
                               "split steps: peak memory O(actors x window), not O(clients per round); null: every "
                               "client's first forward at once")


class FaultPolicy(_Strict):
    """What a run does when an actor dies or a client sends something unusable."""

    max_retries: int = Field(default=3, ge=0, description="Ray: actor deaths survived per run (every actor is "
                             "replaced, the last round boundary restored, the round redone); 0: the first death "
                             "fails the run")
    inject_fault: FaultInjection | None = Field(
        default=None, description="Ray: kill one actor at a chosen point of the run (testing max_retries; "
        "FaultInjection)")
    on_bad_client: Literal["fail", "drop"] = Field(
        default="fail", description="an activation or gradient that is non-finite, of the wrong shape or dtype, "
        "or tagged with another round: fail the run naming client, round and step, or drop that client for the "
        "round (logged as the metric train/dropped_clients and a raysplit.dropped.round_N tag)")


# Keys that RuntimeConfig held directly before it had sections: old key -> its place now. ``placement`` and
# ``transport`` given a single value (not a section) mean the section's first key.
MOVED_RUNTIME_KEYS = {"placement": "placement.strategy", "transport": "transport.kind",  # these two first
                      "spread_clients": "placement.spread_clients", "client_state_mb": "placement.client_state_mb",
                      "spill_dir": "placement.spill_dir", "direct_steps": "transport.direct_steps",
                      "max_in_flight": "transport.max_in_flight", "window": "transport.window",
                      "max_retries": "faults.max_retries", "inject_fault": "faults.inject_fault",
                      "on_bad_client": "faults.on_bad_client", "device": "server.device"}


def _config_warning(message: str) -> None:
    # one line, no source line of ours under it: the user's config is at fault, not this file
    warnings.warn_explicit(message, FutureWarning, "raysplit config", 0)


def _moved(old: str, new: str) -> None:
    _config_warning(f"runtime.{old} is now runtime.{new} (the old key still works; write the new one)")


def moved_key(key: str, value: Any = None) -> str:
    """A dotted override key (``runtime.window``) rewritten to where its field lives now
    (``runtime.transport.window``), with a one-line warning; any other key unchanged."""
    parts = key.split(".")
    if len(parts) < 2 or parts[0] != "runtime" or parts[1] not in MOVED_RUNTIME_KEYS:
        return key
    if parts[1] in ("placement", "transport") and (len(parts) > 2 or isinstance(value, dict)):
        return key  # already the section
    new = MOVED_RUNTIME_KEYS[parts[1]]
    _moved(parts[1], new)
    return ".".join(["runtime", *new.split("."), *parts[2:]])


def migrate_runtime(data: Any) -> Any:
    """A ``runtime`` section written before it had sections, rewritten: each old key moves to its section (a
    one-line FutureWarning names the new key); a setting given both ways is an error naming both keys."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for old, new in MOVED_RUNTIME_KEYS.items():
        if old not in data or (old in ("placement", "transport") and isinstance(data[old], dict | None)):
            continue
        section, key = new.split(".")
        value = data.pop(old)
        current = data.get(section)
        current = dict(current) if isinstance(current, dict) else {}
        if key in current:
            raise ValueError(f"runtime.{old} and runtime.{new} are the same setting; give only runtime.{new}")
        _moved(old, new)
        current[key] = value
        data[section] = current
    return data


class RuntimeConfig(_Strict):
    backend: Literal["ray", "local"] = Field(default="ray", description="ray: hosts in actors; local: the same "
                                             "hosts in this process (identical results)")
    address: str | None = Field(default=None, description="None: start a local Ray; 'auto': join a running cluster")
    num_workers: int = Field(default=2, ge=1, description="client actors hosting the virtual clients")
    num_cpus: int | None = Field(default=None, ge=1, description="logical CPUs for a local Ray")
    object_store_memory: int | None = Field(default=512 * 1024**2, ge=78643200, description="bytes of object "
                                            "store for a local Ray")
    server: ActorResources = Field(default=ActorResources(num_cpus=1.0), description="the server actor's "
                                   "resources")
    client: ActorResources = Field(default=ActorResources(num_cpus=0.5), description="each client actor's "
                                   "resources")
    torch_threads: int | Literal["auto"] | None = Field(
        default=1, description="torch threads per actor (a number: that many in every host, so the metrics are the "
        "same on any backend, transport and number of actors; auto: from the machine and the run's transport at "
        "start, logged as resolved.torch_threads: the local backend's process gets the machine's cores, a private "
        "Ray's actors a share of them over compiled graphs and in the event loop and all of them in a step loop "
        "over actor calls, a cluster's actors their num_cpus rounded up; faster, but the thread count splits CPU "
        "sums, so the last digits of the metrics then follow the backend and transport; null: torch's own default)")

    @field_validator("torch_threads")
    @classmethod
    def _threads_positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1 (or auto, or null for torch's own default)")
        return v
    keep_actors_s: float = Field(default=0.0, ge=0, description="seconds a finished run's actors stay alive for "
                                 "this driver's next run to reuse (a new host in the same process: no process start "
                                 "nor imports, about 5 s of CPU an actor; the same metrics), when Ray outlives the "
                                 "run (a driver that called ray.init or joins runtime.address); 0: killed at the "
                                 "run's end. Idle ones hold their resources until then, or until a run asking for "
                                 "others or a sweep starts")
    pack_clients: bool | Literal["auto"] = Field(default="auto", description="train a client host's clients' "
                                                 "steps together where they are independent (FedAvg's and "
                                                 "Ampere's local training; the forwards and backwards of pooled "
                                                 "split steps: CycleSL, MiniBatch-SFL, MergeSFL, Semi-SFL's "
                                                 "student streams, and PSL, SFLV1, "
                                                 "SFLV3 and MultiHead, whose per-client copies' steps then "
                                                 "interleave): parameters stacked, one vmapped "
                                                 "computation per step for the clients with equal batch shapes "
                                                 "(unequal batches padded where no layer mixes samples), equal to "
                                                 "one client after another within float rounding; not SFLV2 and "
                                                 "the other methods whose one server model steps between clients; "
                                                 "auto: on where client hosts compute on a GPU (on a CPU it is "
                                                 "slower), true: everywhere")
    deterministic: bool | Literal["auto"] = Field(default="auto", description="deterministic kernels "
                                                  "(torch.use_deterministic_algorithms, cuDNN's deterministic "
                                                  "algorithms, a fixed cuBLAS workspace): auto: on in each host "
                                                  "that computes on a GPU (CPU kernels at a fixed thread count "
                                                  "already are); true: in every host")
    placement: PlacementConfig = Field(default=PlacementConfig(), description="which client actor serves a "
                                       "client, and where client state is kept (PlacementConfig)")
    transport: TransportConfig = Field(default=TransportConfig(), description="how split steps travel "
                                       "(TransportConfig)")
    faults: FaultPolicy = Field(default=FaultPolicy(), description="actor deaths and unusable client input "
                                "(FaultPolicy)")
    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        return migrate_runtime(data)

    @model_validator(mode="after")
    def _fault_names_an_actor(self):
        f = self.faults.inject_fault
        if f is not None and f.actor != "server" and int(f.actor[6:]) >= self.num_workers:
            raise ValueError(f"runtime.faults.inject_fault.actor={f.actor!r}: there are {self.num_workers} client "
                             f"actors (client0..client{self.num_workers - 1}, runtime.num_workers)")
        if f is not None and self.backend != "ray":
            raise ValueError("runtime.faults.inject_fault kills an actor: it needs runtime.backend=ray")
        for role in ("server", "client"):
            res = getattr(self, role)
            if self.backend == "ray" and res.device == "cuda" and not res.num_gpus:
                raise ValueError(f"runtime.{role}.device=cuda: Ray gives an actor a GPU only where it holds one; set "
                                 f"runtime.{role}.num_gpus (a fraction shares a GPU: 0.25 puts four actors on one)")
        return self


class PrivacyConfig(_Strict):
    defence: DefenceConfig = Field(default=NoDefence(), description="client-side defence at the cut: kind picks the "
                                   "defence (raysplit list: the defences), the other keys are its own")
    attack: AttackConfig = Field(default=NoAttack(), description="honest-but-curious server's attack, scored at "
                                 "every evaluation (privacy/ metrics): kind picks the attack, the other keys are its "
                                 "own")
    label_defence: LabelDefenceConfig = Field(default=NoLabelDefence(), description="U-shaped split "
                                              "(model.tail_cut): the client's defence on the gradient it returns to "
                                              "the server (raysplit/label_privacy.py): kind none, noise (scale) or "
                                              "max_norm")
    label_attack: LabelAttackConfig = Field(default=NoLabelAttack(), description="U-shaped split: the server's "
                                            "label-leakage attack on the returned gradients, scored per round "
                                            "(privacy/label_* metrics): kind none or gradient_scoring")

    @field_validator("defence", "attack", "label_defence", "label_attack", mode="before")
    @classmethod
    def _default_kind(cls, v):
        """A section without ``kind`` is the default's (none), so a key it does not take is an error naming it."""
        return {"kind": "none", **v} if isinstance(v, dict) and "kind" not in v else v


class TrackingConfig(_Strict):
    enabled: bool = Field(default=True, description="False: no MLflow run (a Tune callback records the trial)")
    uri: str | None = Field(default=None, description="MLflow tracking URI; default $MLFLOW_TRACKING_URI or sqlite:///mlflow.db")
    experiment: str = Field(default="raysplit", description="MLflow experiment")
    run_name: str | None = Field(default=None, description="MLflow run name (null: MLflow names "
                                 "it)")
    tags: dict[str, str] = Field(default_factory=dict, description="tags set on the MLflow run (a sweep's arm: "
                                 "raysplit.arm)")
    checkpoint_every: int = Field(default=0, ge=0, description="rounds; 0 = only at the end")
    output_dir: str = Field(default="outputs", description="where checkpoints and run files go")
    progress: bool = Field(default=True, description="a progress bar on the console")
    log_checkpoint_artifact: bool = Field(default=True, description="log the final checkpoint as an MLflow "
                                          "artifact")
    retry_s: float = Field(default=30.0, ge=0, description="seconds between attempts to deliver spooled calls "
                           "while the tracking store is unreachable (raysplit/tracking.py)")


class ExperimentConfig(_Strict):
    name: str = Field(default="experiment", description="the experiment's name (run names, outputs)")
    seed: int = Field(default=0, description="every random choice derives from it: same seed, same metrics")
    algorithm: SerializeAsAny[AlgorithmParams] = Field(
        default_factory=lambda: algorithm_params({"name": "sflv2"}), description="name and parameters of the "
        "method: validated once by the named algorithm's own Params model (raysplit list ALGORITHM)")
    data: DataConfig = Field(default=DataConfig(), description="dataset and its split over clients")
    model: ModelConfig = Field(default=ModelConfig(), description="model and cut")
    train: TrainConfig = Field(default=TrainConfig(), description="rounds, batches, optimizers, sampling")
    eval: EvalConfig = Field(default=EvalConfig(), description="when and how the model is evaluated")
    runtime: RuntimeConfig = Field(default=RuntimeConfig(), description="Ray, actors, transport, faults")
    clock: ClockConfig = Field(default=HomogeneousClock(), description="the simulated clock: the server's speed and "
                               "how the clients' speeds are drawn, one model per profile (raysplit/clock.py): "
                               "profile picks it, the other keys are its own")
    tracking: TrackingConfig = Field(default=TrackingConfig(), description="MLflow, checkpoints, progress")
    privacy: PrivacyConfig = Field(default=PrivacyConfig(), description="attacks and defences at the cut "
                                   "(raysplit/privacy.py); off by default")

    @model_validator(mode="before")
    @classmethod
    def _batched_copies_moved(cls, data: Any) -> Any:
        """``runtime.batched_copies`` (before it was an algorithm parameter) moves to ``algorithm.batched_copies``
        for the methods that have it, with a one-line warning; the others never used it: dropped, with a warning
        where it was on."""
        runtime = data.get("runtime") if isinstance(data, dict) else None
        if not isinstance(runtime, dict) or "batched_copies" not in runtime:
            return data
        data, runtime = dict(data), dict(runtime)
        value = runtime.pop("batched_copies")
        data["runtime"] = runtime
        alg = dict(data.get("algorithm") or {"name": "sflv2"})
        name = alg.get("name")
        from raysplit.algorithms import ALGORITHMS

        if name in ALGORITHMS and "batched_copies" in ALGORITHMS[name].Params.model_fields:
            if "batched_copies" in alg:
                raise ValueError("runtime.batched_copies and algorithm.batched_copies are the same setting; give "
                                 "only algorithm.batched_copies")
            alg["batched_copies"] = value
            data["algorithm"] = alg
            _config_warning("runtime.batched_copies is now algorithm.batched_copies (the old key still works; write "
                            "the new one)")
        elif value:
            _config_warning(f"runtime.batched_copies is ignored: {name} has no per-client server copies to batch "
                            "(it is algorithm.batched_copies now, for psl, sflv1 and their variants, sglr)")
        return data

    @field_validator("clock", mode="before")
    @classmethod
    def _default_profile(cls, v):
        """A clock section without ``profile`` is the default profile's (homogeneous), as before the section was a
        union: ``clock.client_flops=...`` alone still works."""
        return {"profile": "homogeneous", **v} if isinstance(v, dict) and "profile" not in v else v

    @field_validator("algorithm", mode="before")
    @classmethod
    def _algorithm_params(cls, v: Any) -> AlgorithmParams:
        """The algorithm's own Params, picked by ``name`` in the registry as it is when the config is read (so
        that a method registered after import, docs/extending.md, is known); its errors name algorithm.<key>."""
        if isinstance(v, AlgorithmParams):
            return v
        if not isinstance(v, dict) or "name" not in v:
            raise ValueError("algorithm.name is required")
        return algorithm_params(v)

    @property
    def algorithm_name(self) -> str:
        return self.algorithm.name


def _parse_scalar(text: str) -> Any:
    """Parse an override value with YAML rules (numbers, bools, null, lists); ``1e-3`` is a float too."""
    if text == "":
        return ""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_overrides(raw: dict, overrides: list[str] | dict[str, Any]) -> dict:
    """Apply dotted overrides (``train.rounds=3`` or ``{"train.rounds": 3}``) to a raw config dict."""
    out = copy.deepcopy(raw)
    if isinstance(out.get("runtime"), dict):  # an old file's keys first, so that new-style overrides find sections
        try:
            out["runtime"] = migrate_runtime(out["runtime"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
    items = overrides.items() if isinstance(overrides, dict) else []
    if not isinstance(overrides, dict):
        parsed = []
        for ov in overrides:
            if "=" not in ov:
                raise ConfigError(f"override {ov!r} is not of the form key=value")
            k, v = ov.split("=", 1)
            parsed.append((k.strip(), _parse_scalar(v)))
        items = parsed
    for key, value in items:
        node = out
        parts = moved_key(key, value).split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {key!r}: {p!r} is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def tag_key(model: type[BaseModel]) -> str:
    """The key that picks ``model`` in its discriminated union: ``name`` (partitioners), ``profile`` (the clock) or
    ``kind`` (the privacy plug-ins)."""
    return next((k for k in ("name", "profile") if k in model.model_fields), "kind")


def tagged_members(ann: Any) -> dict[str, type[BaseModel]]:
    """``{tag: model}`` of a discriminated union on ``name``, ``profile`` or ``kind`` (PartitionConfig, ClockConfig,
    DefenceConfig, AttackConfig); empty for anything else."""
    args = typing.get_args(ann)
    if args and typing.get_origin(ann) is Annotated:
        args = typing.get_args(args[0])
    out = {}
    for a in args:
        if isinstance(a, type) and issubclass(a, BaseModel) and tag_key(a) in a.model_fields:
            tags = typing.get_args(a.model_fields[tag_key(a)].annotation)
            out.update({t: a for t in tags})
    return out


def _resolve(model: type[BaseModel], loc: tuple) -> tuple[list[str], type[BaseModel] | None, str | None]:
    """The dotted key of ``loc`` as a user writes it (a discriminated union's tag, which pydantic puts in the
    location, dropped), the model of its last section (None: not a section) and, when that section is a member of
    a discriminated union, its tag."""
    parent: type[BaseModel] | None = model
    key: list[str] = []
    members: dict = {}
    tag = None
    for p in loc:
        if members and str(p) in members:  # the tag pydantic inserts after a discriminated union's field
            parent, members, tag = members[str(p)], {}, str(p)
            continue
        key.append(str(p))
        field = parent.model_fields.get(str(p)) if parent is not None else None
        ann = field.annotation if field else None
        members, tag = tagged_members(ann), None
        parent = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return key, parent, tag


def _format_error(err: ValidationError, model: type[BaseModel]) -> str:
    lines: list[str] = []
    unknown: dict[tuple, list[str]] = {}  # the unknown keys of one section: one sentence for them all
    for e in err.errors():
        key, _, _ = _resolve(model, e["loc"])
        if e["type"] == "extra_forbidden":
            unknown.setdefault(tuple(e["loc"][:-1]), []).append(".".join(key))
        else:
            lines.append(f"bad value for '{'.'.join(key)}': {e['msg']} (got {e.get('input')!r})")
    for loc, keys in unknown.items():
        section, parent, tag = _resolve(model, loc)
        allowed = sorted(parent.model_fields) if parent is not None else []
        what = hint = ""
        if tag is not None:  # a member of a discriminated union (a partitioner, a defence), picked by its name/kind
            kind = getattr(parent, "KIND", "name")
            what = f" ({kind} {tag})"
            hint = f" (to switch {kind}, give the whole section: {'.'.join(section)}={{{tag_key(parent)}: {tag}}})"
        lines.append(f"unknown key{'s' if len(keys) > 1 else ''} {', '.join(repr(k) for k in keys)}{what}"
                     + (f"; allowed here: {', '.join(allowed)}" if allowed else "") + hint)
    return "invalid config: " + "; ".join(lines)


def validate(raw: dict) -> ExperimentConfig:
    """Validate a raw dict into an ExperimentConfig, including the algorithm's own parameters."""
    try:
        cfg = ExperimentConfig.model_validate(raw or {})
    except ValidationError as err:
        for e in err.errors():  # the algorithm's own check already names algorithm.<key>: its message as it is
            if isinstance(e.get("ctx", {}).get("error"), ConfigError):
                raise e["ctx"]["error"] from None
        raise ConfigError(_format_error(err, ExperimentConfig)) from None
    get_algorithm(cfg.algorithm_name).check_config(cfg.algorithm, cfg)  # combinations with the rest of the config
    return cfg


def yaml_error(path: Path, e: Exception) -> str:
    """A YAML syntax error as one message naming the file, the line and the column (counted from 1) and what is
    wrong there (PyYAML's own text points at ``"<unicode string>"``)."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return f"config file {path} is not valid YAML: {e}"
    what = getattr(e, "problem", None) or "syntax error"
    context = getattr(e, "context", None)
    line = mark.buffer.splitlines()[mark.line] if mark.buffer and mark.line < len(mark.buffer.splitlines()) else ""
    return (f"config file {path}, line {mark.line + 1}, column {mark.column + 1}: {what}"
            + (f" ({context})" if context else "") + (f": {line.strip()!r}" if line.strip() else ""))


def load_config(path: str | Path | None, overrides: list[str] | dict | None = None) -> ExperimentConfig:
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(yaml_error(p, e)) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    if overrides:
        raw = apply_overrides(raw, overrides)
    return validate(raw)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts to dotted keys (MLflow params, sweep spaces)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def dump(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
