"""Run an experiment: prepare everything on the driver (config, data, partition, model and cut — all errors
surface here, before any actor starts), start the runtime, hand the algorithm to its driver (rounds or events),
checkpoint, and finish. What is recorded and logged lives in ``reporting.py``; the loops in
``runtime/driver/drivers.py`` and ``runtime/server/events.py``."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from raysplit.algorithms import SetupInfo, get_algorithm
from raysplit.algorithms.base import clients_per_round
from raysplit.config import ExperimentConfig, dump
from raysplit.errors import ConfigError
from raysplit.runtime import HostPlan, Method, ModelFacts, RuntimeInputs, Sections, make_backend, runtime_for, transport
from raysplit.models.tiers import client_cuts, client_ranks, describe, ranked_lm, tiered_parts
from raysplit.runtime.server.events import EventPlan
from raysplit.runtime.driver.drivers import RoundGuard
from raysplit import tags


@dataclass
class Prepared:
    cfg: ExperimentConfig
    algorithm: object
    inputs: RuntimeInputs
    sample_stream: np.ndarray  # (rounds, clients per round)
    eval_mode: str
    num_classes: int
    partition_counts: np.ndarray
    partition_summary: dict
    cut: int | None
    cut_name: str | None
    dataset: dict = field(default_factory=dict)  # provenance: name, source, files, partition, sizes (digest added when logged)
    text: object = None  # a language model's raysplit.data.text.TextData: its tokenizer (an artifact) and prompts


def sample_stream(seed: int, num_clients: int, per_round: int, rounds: int) -> np.ndarray:
    """The client-sampling stream: depends only on (seed, V, m, rounds), so it is identical across algorithms."""
    rng = np.random.default_rng([seed, 0x5A3])
    return np.stack([rng.choice(num_clients, per_round, replace=False) for _ in range(rounds)])


def cut_shape(model, cut: int | None, data_spec) -> tuple | None:
    """The per-sample shape of what crosses the cut: the client blocks' output on zeros (None without a cut)."""
    if cut is None:
        return None
    kind = torch.long if data_spec.kind == "tokens" else torch.float32
    client = model.split(cut)[0]
    flags = [(m, m.training) for m in client.modules()]
    client.eval()
    try:
        with torch.no_grad():
            return tuple(client(torch.zeros((1, *data_spec.input_shape), dtype=kind)).shape[1:])
    finally:
        for m, flag in flags:
            m.training = flag


def client_cuts_of(cfg: ExperimentConfig, alg, model, num_clients: int, profiles) -> tuple[int, ...] | None:
    """Each client's cut from ``model.tiers`` or ``model.cut_budget`` (None: neither), checked against the model,
    the clients and the method before any actor exists: one ConfigError naming the key or the method."""
    why_not = lambda cut: None  # noqa: E731
    if cfg.model.lm is not None and (cfg.model.tiers is not None or cfg.model.cut_budget is not None):
        from raysplit.models.causal_lm import resolve_lm_cut
        from raysplit.models.tiers import lm_cut_refused

        tail = None if cfg.model.lm.split == "plain" else (
            len(model.blocks) - 1 if cfg.model.tail_cut is None else resolve_lm_cut(model, cfg.model.tail_cut,
                                                                                 "model.tail_cut"))
        why_not = lm_cut_refused(model, tail)
    try:
        cuts = client_cuts(model, cfg.model, num_clients, [p.flops for p in profiles], cfg.seed,
                           cfg.train.batch_size, why_not)
        client_ranks(cfg.model, cuts, model)  # a bad rank: one error naming the key, here
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cuts is None or len(set(cuts)) == 1:
        return cuts
    key = "model.tiers" if cfg.model.tiers is not None else "model.cut_budget"
    why = alg.tiers_refused()
    if not why and getattr(alg.params, "batched_copies", False):
        why = "algorithm.batched_copies batches copies of one shape; copies entered at other cuts are not built yet"
    if not why and any(getattr(cfg.privacy, k).kind != "none" for k in ("defence", "attack", "label_defence",
                                                                          "label_attack")):
        why = "the privacy plug-ins at the cut assume one cut"
    if why:
        raise ConfigError(f"{key}: {alg.name} cannot take clients with their own cuts: {why}")
    return cuts


def language_model_section(cfg: ExperimentConfig, alg) -> "object | None":
    """The run's ``model.lm`` section (None: a model of the zoo), checked: a language model needs ``data.text``
    and a method whose steps take one (``Algorithm.language_model``: why not; asynchronous split methods not yet;
    asynchronous FL, the whole model on the clients, runs one), and
    ``data.text`` needs one."""
    lm, text = cfg.model.lm, cfg.data.text
    if lm is None and text is None:
        return None
    if lm is None or text is None:
        given, missing = ("model.lm", "data.text") if text is None else ("data.text", "model.lm")
        raise ConfigError(f"{given} is set but {missing} is not: a language model trains on text (data.text) and "
                          f"text trains a language model (model.lm)")
    if alg.language_model:
        raise ConfigError(f"algorithm={alg.name} cannot train a language model (model.lm): "
                          f"{alg.language_model.format(name=alg.name)}")
    if alg.driver.asynchronous and alg.split:
        raise ConfigError(f"algorithm={alg.name} cannot train a language model (model.lm): the event loop predicts "
                          f"a split client's clock from activation messages of class-labelled samples (one label "
                          f"each; not built for token blocks yet)")
    return lm


def lm_tail_cut(lm, model, cut: int | None, tail_cut, alg):
    """A language model's ``model.tail_cut``: U-shaped by default (``model.lm.split``), the head and the loss on
    the client after the last decoder block unless ``model.tail_cut`` names another; None for a plain split or a
    method without a cut (FedAvg: the whole model and the text stay on the clients). A method that cannot run
    U-shaped, or a cut that leaves the server no block, is one error saying how to send the text instead."""
    if cut is None:
        return None
    if lm.split == "plain":
        if tail_cut is not None:
            raise ConfigError(f"model.tail_cut={tail_cut!r} makes the split U-shaped but model.lm.split=plain; "
                              f"set model.lm.split=u_shaped or model.tail_cut=null")
        return None
    why = ("model.lm.split=u_shaped (the default: a language model's tokens are its labels and stay on the "
           "clients)")
    if alg.u_shape:
        raise ConfigError(f"{why}: {alg.u_shape.format(name=alg.name)}; set model.lm.split=plain to send the text "
                          f"to the server")
    if tail_cut is not None:
        return tail_cut
    last = len(model.blocks) - 1  # the cut after the last decoder block: the head alone is the tail
    if cut >= last:
        raise ConfigError(f"{why}: model.cut={model.block_names[cut - 1]!r} leaves the server no block before the "
                          f"head; cut earlier or set model.lm.split=plain")
    return last


def base_facts(lm, model, seed: int) -> dict:
    """A LoRA language model's frozen base as every side rebuilds it (``ModelFacts.base_seed``, ``base_digest``):
    from its source (``model.lm``: its sizes or its local directory) with the run's seed, checked against this
    digest; none for full fine-tuning and the zoo's models (their states carry every weight)."""
    if lm is None or lm.adapter.kind != "lora":
        return {}
    from raysplit.models.adapters import base_digest

    return {"base_seed": int(seed), "base_digest": base_digest(model)}


def base_record(prepared) -> dict | None:
    """What a checkpoint of a LoRA language model says of its frozen base, which it does not hold (its states
    are the adapters): the source every side rebuilds it from (``model.lm.pretrained``'s directory, or the
    config's sizes with the seed; the config itself is saved beside it) and its digest, checked on resume."""
    facts = prepared.inputs.plan.model
    if not facts.shares_base:
        return None
    return {"source": facts.lm.pretrained or "model.lm (random initial weights)", "seed": facts.base_seed,
            "digest": facts.base_digest}


def _text_inputs(cfg: ExperimentConfig, lm):
    """A language model's data and model (``prepare``'s text branch): the blocks of ``data.text`` partitioned
    over the clients, the labels of a block its tokens (E2E's prompts masked out under ``data.text.loss_on:
    completion``; the partition statistics count blocks per source), and the
    model built fixed-length (what crosses the cut is the hidden states tensor) from ``model.lm`` and the
    tokenizer's vocabulary, checked against the context length and the tokenizer."""
    from raysplit.data import partition_counts
    from raysplit.data.text import load_text_partitioned
    from raysplit.models.causal_lm import build_causal_lm, check_context_length, check_tokenizer_vocab

    if cfg.data.n_labeled:
        raise ConfigError(f"data.n_labeled={cfg.data.n_labeled}: a language model's text has no labelled set")
    text = load_text_partitioned(cfg.data.text, cfg.data.partition, cfg.data.num_clients, cfg.data.test_fraction,
                                 cfg.seed, pretrained=lm.pretrained)
    torch.manual_seed(cfg.seed)
    model = build_causal_lm(lm, vocab_size=text.spec.num_classes, fixed_length=True)
    check_context_length(model, cfg.data.text.context_length)
    check_tokenizer_vocab(model, text.tokenizer.vocab_size, text.tokenizer.source)
    spec = text.spec if model.vocab_size == text.spec.num_classes else dataclasses.replace(
        text.spec, num_classes=model.vocab_size)  # the model's vocabulary: what every side builds
    counts = partition_counts(text.train_idx, np.asarray(text.y_train), len(text.source_names))
    files = text.provenance["files"]
    dataset = {**text.provenance, "source": os.path.commonpath(files) if len(files) > 1 else "".join(files),
               "train_samples": int(len(text.x_train)), "test_samples": int(len(text.x_test))}  # the run's input
    return (spec, text.x_train, text.t_train, text.x_test, text.t_test, text.train_idx, text.test_idx, {},
            dataset, counts, model, text)


def prepare(cfg: ExperimentConfig) -> Prepared:
    from raysplit.data import load_partitioned, partition_counts, partition_summary
    from raysplit.models import MODELS, build_model
    from raysplit.label_privacy import ushape_spec
    from raysplit.privacy import privacy_spec

    alg = get_algorithm(cfg.algorithm_name)(cfg.algorithm, cfg)
    lm = language_model_section(cfg, alg)
    if lm is not None:
        (spec_d, x_tr, y_tr, x_te, y_te, train_idx, test_idx, labeled_data, dataset, counts, model,
         text) = _text_inputs(cfg, lm)
        want = cfg.model.cut if cfg.model.cut is not None else model.default_cut
    else:
        text = None
        spec_d, (x_tr, y_tr, x_te, y_te), train_idx, test_idx, labeled_data, dataset = load_partitioned(cfg.data,
                                                                                                        cfg.seed)
        counts = partition_counts(train_idx, np.asarray(y_tr), spec_d.num_classes)
        if cfg.model.name not in MODELS:
            raise ConfigError(f"unknown model.name {cfg.model.name!r}; registered: {', '.join(sorted(MODELS))}")
        torch.manual_seed(cfg.seed)
        try:
            model = build_model(cfg.model.name, spec_d.num_classes, tuple(spec_d.input_shape), **cfg.model.options)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model: cannot build {cfg.model.name!r} for {cfg.data.dataset}: {e}") from None
        want = cfg.model.cut if cfg.model.cut is not None else MODELS[cfg.model.name].default_cut
    num_clients = len(train_idx)
    profiles = cfg.clock.draw(num_clients, np.random.default_rng([cfg.seed, 2]))
    cuts = client_cuts_of(cfg, alg, model, num_clients, profiles)  # None: one cut for every client
    if cuts is not None:
        want, cuts = (cuts[0], None) if len(set(cuts)) == 1 else (min(cuts), cuts)  # one tier: today's run
    cut, client, server = alg.split_model(model, want)
    tail_cut = cfg.model.tail_cut if lm is None else lm_tail_cut(lm, model, cut, cfg.model.tail_cut, alg)
    if lm is not None and cuts is None and cut and not any(
            p.requires_grad for p in model.segment(0, cut).parameters()):  # LoRA's default leaves the embeddings
        raise ConfigError(f"model.cut={model.block_names[cut - 1]!r}: the client's blocks "
                          f"({', '.join(model.block_names[:cut])}) train nothing (no adapter in them: "
                          f"model.lm.adapter.target_modules, e.g. add 'wte'); cut deeper")
    ushape, u_client, u_server = ushape_spec(model, max(cuts) if cuts else cut, tail_cut, cfg.privacy, alg.name,
                                             alg.u_shape, getattr(alg.params, "batched_copies", False),
                                             spec_d.num_classes)
    if ushape is not None:  # U-shaped: the client holds the head and the tail, the server the middle
        client, server = u_client, u_server
    ranks = client_ranks(cfg.model, cuts, model) if cuts is not None else None  # tiered LoRA ranks, per client
    if cuts is not None:  # the clients' blocks up to the deepest cut, the server's from the shallowest on
        client, server = tiered_parts(model, cuts, ushape.tail_cut if ushape is not None else None)
    if ranks is not None:  # the clients' blocks at the largest rank: the shapes their aggregate is held at
        from raysplit.models.causal_lm import build_causal_lm

        torch.manual_seed(cfg.seed)  # the same frozen base as ``model`` (its adapters at another rank)
        wide = build_causal_lm(ranked_lm(lm, max(max(ranks), lm.adapter.rank)), vocab_size=spec_d.num_classes,
                               fixed_length=True)
        client = tiered_parts(wide, cuts, ushape.tail_cut if ushape is not None else None)[0]
    cut_name = None if cut is None else next((n for n, i in model.cut_points().items() if i == cut), str(cut))
    if cuts is not None:  # tiered: the cuts' names and their clients ("conv1:10,conv2:10"), logged and compared
        cut_name = describe(model, cuts)

    m = clients_per_round(cfg, num_clients)
    alg.setup(SetupInfo(model=model, cut=cut, counts=counts, num_classes=spec_d.num_classes, seed=cfg.seed,
                        clients_per_round=m, profiles=tuple(profiles), cuts=cuts))
    modes = alg.eval_modes()
    eval_mode = modes[0] if cfg.eval.mode == "auto" else cfg.eval.mode
    if eval_mode not in modes:
        why = ("needs a global client model, and it keeps per-client models"
               if eval_mode == "global" and not alg.keeps_global_client_model() else "is not available")
        raise ConfigError(f"eval.mode={eval_mode} {why} for {alg.name} (supported: {', '.join(modes)})")
    if eval_mode == "clients" and cfg.data.test_fraction == 0:
        raise ConfigError("eval.mode=clients needs data.test_fraction > 0 (per-client test splits)")
    if cfg.eval.validation:
        if eval_mode != "global":
            raise ConfigError(f"eval.validation=true evaluates the clients' held-out splits beside the global test "
                              f"set; it needs eval.mode=global (here {eval_mode}: those splits are the test set)")
        if "clients" not in modes:
            raise ConfigError(f"eval.validation=true: {alg.name} cannot evaluate the clients' held-out splits "
                              f"(its eval modes: {', '.join(modes)})")
        if cfg.data.test_fraction == 0:
            raise ConfigError("eval.validation=true needs data.test_fraction > 0 (the held-out split each client "
                              "validates on)")

    sizes = tuple(int(n) for n in counts.sum(axis=1))
    events = EventPlan(active=m, local_steps=cfg.train.local_steps, client_sizes=sizes, profiles=tuple(profiles),
                       split=alg.split) if alg.driver.asynchronous else None
    plan = HostPlan(
        sections=Sections(train=cfg.train, eval=cfg.eval, clock=cfg.clock, runtime=cfg.runtime, seed=cfg.seed),
        model=ModelFacts(name=cfg.model.name, options=dict(cfg.model.options), inputs=spec_d, cut=cut,
                         tail_cut=ushape.tail_cut if ushape is not None else None,
                         cut_shape=cut_shape(model, cut, spec_d), cuts=cuts, lm=lm, ranks=ranks,
                         **base_facts(lm, model, cfg.seed)),
        method=Method(params=alg.params, setup=alg.host_setup(), client_rule=alg.client_rule,
                      server_rule=alg.server_rule, persist_client_models=not alg.keeps_global_client_model(),
                      asynchronous=alg.driver.asynchronous),
        privacy=privacy_spec(cfg.privacy, alg.name, alg.keeps_global_client_model(), cut, cfg.data.dataset,
                             tuple(spec_d.input_shape), x_te, num_clients, lm=lm),
        ushape=ushape, events=events)
    inputs = RuntimeInputs(
        plan=plan, server_host=alg.driver.server_host,
        train_data={"x": np.ascontiguousarray(x_tr), "y": np.asarray(y_tr, dtype=np.int64)},
        test_data={"x": np.ascontiguousarray(x_te), "y": np.asarray(y_te, dtype=np.int64)}, labeled_data=labeled_data,
        train_idx=train_idx, test_idx=test_idx,
        profiles=profiles,
        client_init=transport.pack_state(client.state_dict()), server_init=transport.pack_state(server.state_dict()),
    )
    return Prepared(cfg, alg, inputs, sample_stream(cfg.seed, num_clients, m, cfg.train.rounds), eval_mode,
                    spec_d.num_classes, counts, partition_summary(counts), cut, cut_name, dataset, text)


def _atomic_save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_checkpoint(run_id: str, uri: str | None) -> dict:
    from raysplit.tracking import get_run

    run = get_run(run_id, uri)
    path = run.data.tags.get(tags.CHECKPOINT)
    if not path or not Path(path).is_file():
        raise ConfigError(f"run {run_id} has no checkpoint to resume from (tag raysplit.checkpoint={path!r})")
    return load_checkpoint_file(Path(path))


# what a raysplit checkpoint may name besides raysplit's and torch.nn's classes: numpy arrays (an empty one, e.g. a
# client with no test set, holds bytes()) and generators
_NUMPY_GLOBALS = {"numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.dtype",
                  "numpy.ndarray", "numpy.random._pcg64.PCG64", "numpy.random._pickle.__bit_generator_ctor",
                  "numpy.random._pickle.__generator_ctor", "numpy.random.bit_generator.SeedSequence",
                  "numpy.random.bit_generator.__pyx_unpickle_SeedSequence",
                  "builtins.bytes"}  # pickle protocol 2 writes b"" (an empty array's data) as bytes()
# the functions a checkpoint may name: the model's loss, which the event loop's plan keeps (ModelFacts.loss)
_LOSS_FUNCTIONS = {"torch.nn.functional.cross_entropy", "raysplit.lm_metrics.lm_loss"}


# classes a checkpoint written before the runtime's rooms (issue 69, 2026-12) names by their old place: the old name
# -> where the class lives now (dotted; its pickled state is the same)
MOVED_CLASSES = {"raysplit.runtime.events.ClientCosts": "raysplit.runtime.server.events.ClientCosts",
                 "raysplit.runtime.events.EventLoop": "raysplit.runtime.server.events.EventLoop",
                 "raysplit.runtime.events.EventSetup": "raysplit.runtime.server.events.EventPlan",
                 "raysplit.runtime.events.Job": "raysplit.runtime.server.events.Job",
                 "raysplit.runtime.events.Ready": "raysplit.runtime.server.events.Ready"}


def load_checkpoint_file(path: Path) -> dict:
    """``torch.load(weights_only=True)`` with an allowlist: tensors, containers, numpy arrays and generators, and
    classes of raysplit and torch.nn, and no function but the model's loss (``_LOSS_FUNCTIONS``). A checkpoint
    naming anything else (a tampered file) or one
    that cannot be read (truncated) is a :class:`ConfigError` naming the file, before any of it is unpickled."""
    import importlib

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - not a zip, truncated: one error naming the file
        raise ConfigError(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e)[:300]}); it is damaged "
                          "or not a raysplit checkpoint") from None
    allowed = [c for c in vars(np.dtypes).values() if isinstance(c, type)]  # numpy arrays' dtype classes
    for name in names:
        module, _, attr = MOVED_CLASSES.get(name, name).rpartition(".")
        obj = None
        if name in _NUMPY_GLOBALS or module.startswith(("raysplit.", "torch.nn.modules.")):
            try:
                obj = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError):
                obj = None
            if name not in _NUMPY_GLOBALS and not isinstance(obj, type):
                obj = None
        elif name in _LOSS_FUNCTIONS:
            obj = getattr(importlib.import_module(module), attr)
        if obj is None:
            raise ConfigError(f"checkpoint {path} names {name}, which a raysplit checkpoint never holds; refusing to "
                              "load it (tampered with, or not a raysplit checkpoint)")
        allowed.append((obj, name) if name in MOVED_CLASSES else obj)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True, map_location="cpu")  # each host moves its own to its device
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"checkpoint {path} could not be loaded ({type(e).__name__}: {str(e)[:300]})") from None


def run_experiment(cfg: "ExperimentConfig | str | Path", resume_run_id: str | None = None,
                   on_round: Callable[[int, dict], None] | None = None, checkpoint_file: str | Path | None = None,
                   on_checkpoint: Callable[[int, Path, str], None] | None = None) -> dict:
    """Run (or resume) one experiment tracked in MLflow. Returns the final metrics (plus ``run_id``).

    ``checkpoint_file``: resume from this checkpoint file (a Tune trial's checkpoint) with ``cfg`` as given, instead
    of the file the run ``resume_run_id`` names; with ``resume_run_id`` that MLflow run is continued.
    ``on_checkpoint(round, path, run_id)`` is called after each checkpoint is written (after ``on_round``).
    ``cfg`` may also be a config file's path (``raysplit.run`` takes overrides too)."""
    from raysplit.reporting import Reporter
    from raysplit.tracking import Tracker, code_version

    if isinstance(cfg, (str, Path)):
        from raysplit.config import load_config

        cfg = load_config(cfg)
    ckpt = None
    if checkpoint_file is not None:
        ckpt = load_checkpoint_file(Path(checkpoint_file))
    elif resume_run_id:
        import yaml

        from raysplit.config import validate

        ckpt = _load_checkpoint(resume_run_id, cfg.tracking.uri)
        cfg = validate(yaml.safe_load(ckpt["config"]))
    prepared = prepare(cfg)  # every config/data/model error is raised here, before any actor exists
    base = base_record(prepared)
    if ckpt is not None and ckpt.get("base") is not None and base is not None and ckpt["base"] != base:
        raise ConfigError(f"model.lm: the checkpoint's adapters were trained over the frozen base {ckpt['base']}, "
                          f"but this run builds {base}; resume with the same model.lm source and seed")
    backend = make_backend(cfg.runtime)
    backend.connect()  # Ray up and the actors' resources checked before any MLflow run or actor exists
    tcfg = cfg.tracking
    tracker = Tracker(tcfg.uri, tcfg.experiment, tcfg.run_name or cfg.name, run_id=resume_run_id,
                      enabled=tcfg.enabled, output_dir=tcfg.output_dir, retry_s=tcfg.retry_s)
    with tracker:
        out_dir = Path(tcfg.output_dir) / tracker.run_id
        out_dir.mkdir(parents=True, exist_ok=True)
        ckpt_path = (out_dir / "checkpoint.pt").resolve()
        reporter = Reporter(prepared, tracker, out_dir, ckpt["history"] if ckpt else None, on_round)
        if ckpt is None:
            reporter.start()
        tracker.set_tags({tags.ALGORITHM: cfg.algorithm_name, tags.CHECKPOINT: ckpt_path,
                          **code_version(), **tcfg.tags})
        if ckpt is None and tracker.enabled:  # the files' digest only where it is logged (it reads every file)
            from raysplit.data import files_digest

            files = prepared.dataset["files"]
            tracker.log_input({**prepared.dataset, "digest": files_digest(files) if files else "generated"})
        rt = runtime_for(cfg.runtime, prepared.inputs, backend)  # starts the actors
        if ckpt is None:  # what the backend resolved (transport, threads) once the actors exist
            tracker.log_params({f"resolved.{k}": v for k, v in backend.resolved().items()})
        guard = None
        try:
            alg = prepared.algorithm
            driver = alg.driver(rt, alg, prepared.sample_stream, cfg.seed)
            start = 0
            if ckpt is not None:
                rt.load_state_dict(ckpt["runtime"])
                driver.load_state_dict(ckpt["driver"])
                start = ckpt["round"] + 1
            reporter.begin()

            def after_round(rnd: int, stats) -> None:
                last = rnd == cfg.train.rounds - 1 or alg.finished()
                reporter.record(rnd, stats, rt, driver.global_handle, last)
                every = tcfg.checkpoint_every
                if last or (every and (rnd + 1) % every == 0):
                    _atomic_save({"round": rnd, "history": reporter.hist, "runtime": rt.state_dict(),
                                  "driver": driver.state_dict(), "config": dump(cfg), "base": base}, ckpt_path)
                    if on_checkpoint is not None:
                        on_checkpoint(rnd, ckpt_path, tracker.run_id)

            guard = None
            if cfg.runtime.backend == "ray":  # with max_retries=0 it only names the round in the error

                def restarted(count: int, why: str) -> None:
                    print(f"raysplit: {why}; every actor replaced and the round redone (restart {count} of at most "
                          f"{cfg.runtime.faults.max_retries})", file=sys.stderr)
                    tracker.set_tags({tags.ACTOR_RESTARTS: count, tags.restart(count): why[:4000]})

                guard = RoundGuard(rt, driver, cfg.runtime.faults.max_retries, extra=reporter, on_restart=restarted,
                                   start=start)
            driver.run(start, cfg.train.rounds, after_round, guard)
            out = reporter.finish(driver.client_totals(), ckpt_path)
            alg.close(rt)
            return out
        finally:
            if guard is not None:
                guard.close()
            rt.shutdown()
