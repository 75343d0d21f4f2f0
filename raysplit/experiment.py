"""Run an experiment: prepare everything on the driver (config, data, partition, model and cut — all errors
surface here, before any actor starts), start the runtime, loop rounds, evaluate, track, checkpoint."""

from __future__ import annotations

import csv
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from raysplit import metrics as M
from raysplit.algorithms import algorithm_params, get_algorithm
from raysplit.clock import draw_profiles
from raysplit.config import ConfigError, ExperimentConfig, dump, flatten
from raysplit.runtime import HostSpec, Runtime, RuntimeInputs, make_backend, transport


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


def sample_stream(seed: int, num_clients: int, per_round: int, rounds: int) -> np.ndarray:
    """The client-sampling stream: depends only on (seed, V, m, rounds), so it is identical across algorithms."""
    rng = np.random.default_rng([seed, 0x5A3])
    return np.stack([rng.choice(num_clients, per_round, replace=False) for _ in range(rounds)])


def clients_per_round(cfg: ExperimentConfig, num_clients: int) -> int:
    p = cfg.train.participation
    if p.count is not None:
        if p.count > num_clients:
            raise ConfigError(f"train.participation.count={p.count} exceeds data.num_clients={num_clients}")
        return p.count
    return max(1, math.ceil((p.fraction or 1.0) * num_clients))


def prepare(cfg: ExperimentConfig) -> Prepared:
    from raysplit.data import client_train_test_split, load_dataset, partition, partition_counts, partition_summary
    from raysplit.models import MODELS, build_model

    alg_cls = get_algorithm(cfg.algorithm_name)
    params = algorithm_params(cfg.algorithm)
    alg = alg_cls(params, cfg)

    bundle = load_dataset(cfg.data.dataset, cfg.data.root, **cfg.data.options)
    spec_d = bundle.spec
    rng = np.random.default_rng([cfg.seed, 1])
    x_tr, y_tr, x_te, y_te = bundle.x_train, bundle.y_train, bundle.x_test, bundle.y_test
    if cfg.data.partition.name == "natural":
        if bundle.natural_train is None:
            raise ConfigError(f"data.partition.name=natural needs a dataset with natural clients (LEAF); "
                              f"{cfg.data.dataset} has none")
        parts = list(bundle.natural_train)
        if cfg.data.num_clients < len(parts):
            parts = parts[:cfg.data.num_clients]
    else:
        if cfg.data.max_train_samples and cfg.data.max_train_samples < len(y_tr):
            keep = np.sort(rng.choice(len(y_tr), cfg.data.max_train_samples, replace=False))
            x_tr, y_tr = x_tr[keep], y_tr[keep]
        try:
            parts = partition(cfg.data.partition.name, np.asarray(y_tr), cfg.data.num_clients, rng,
                              **cfg.data.partition.params())
        except ValueError as e:
            raise ConfigError(f"data.partition: {e}") from None
    if cfg.data.max_test_samples and cfg.data.max_test_samples < len(y_te):
        keep = np.sort(np.random.default_rng([cfg.seed, 3]).choice(len(y_te), cfg.data.max_test_samples,
                                                                    replace=False))
        x_te, y_te = x_te[keep], y_te[keep]
    train_idx, test_idx = client_train_test_split(parts, cfg.data.test_fraction, rng)
    num_clients = len(train_idx)
    counts = partition_counts(train_idx, np.asarray(y_tr), spec_d.num_classes)

    if cfg.model.name not in MODELS:
        raise ConfigError(f"unknown model.name {cfg.model.name!r}; registered: {', '.join(sorted(MODELS))}")
    torch.manual_seed(cfg.seed)
    try:
        model = build_model(cfg.model.name, spec_d.num_classes, tuple(spec_d.input_shape), **cfg.model.options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model: cannot build {cfg.model.name!r} for {cfg.data.dataset}: {e}") from None
    if alg_cls.full_model_on_client:
        cut, cut_name = None, None
        client, server = model, torch.nn.Identity()
    else:
        want = cfg.model.cut if cfg.model.cut is not None else MODELS[cfg.model.name].default_cut
        try:
            cut = model.resolve_cut(want)
        except ValueError as e:
            raise ConfigError(f"model.cut: {e}") from None
        cut_name = next((n for n, i in model.cut_points().items() if i == cut), str(cut))
        client, server = model.split(cut)

    from raysplit.algorithms import SetupInfo

    alg.setup(SetupInfo(model=model, cut=cut, counts=counts, num_classes=spec_d.num_classes, seed=cfg.seed))
    eval_mode = cfg.eval.mode
    global_ok = alg_cls.aggregates_clients or alg_cls.evaluates_itself
    if eval_mode == "auto":
        eval_mode = "global" if global_ok else "clients"
    if eval_mode == "global" and not global_ok:
        raise ConfigError(f"eval.mode=global needs a global client model; {alg_cls.name} keeps per-client models "
                          "(use eval.mode=clients)")
    if eval_mode == "clients" and cfg.data.test_fraction == 0:
        raise ConfigError("eval.mode=clients needs data.test_fraction > 0 (per-client test splits)")

    opt = cfg.train.optimizer.model_dump()
    spec = HostSpec(
        model=cfg.model.name, num_classes=spec_d.num_classes, input_shape=tuple(spec_d.input_shape),
        model_options=dict(cfg.model.options), cut=cut, client_optimizer=opt,
        server_optimizer=(cfg.train.server_optimizer.model_dump() if cfg.train.server_optimizer else opt),
        data_spec=spec_d, batch_size=cfg.train.batch_size, seed=cfg.seed, eval_batch_size=cfg.eval.batch_size,
        torch_threads=cfg.runtime.torch_threads, device=cfg.runtime.device, server_flops=cfg.clock.server_flops,
        persist_client_models=alg_cls.clients_keep_models,
        extra={"stop_on_nonfinite": cfg.train.stop_on_nonfinite, **alg.host_extra()},
    )
    inputs = RuntimeInputs(
        spec=spec, client_host=alg_cls.client_host, server_host=alg_cls.server_host,
        train_data={"x": np.ascontiguousarray(x_tr), "y": np.asarray(y_tr, dtype=np.int64)},
        test_data={"x": np.ascontiguousarray(x_te), "y": np.asarray(y_te, dtype=np.int64)},
        train_idx=train_idx, test_idx=test_idx,
        profiles=draw_profiles(cfg.clock, num_clients, np.random.default_rng([cfg.seed, 2])),
        client_init=transport.pack_state(client.state_dict()), server_init=transport.pack_state(server.state_dict()),
    )
    m = clients_per_round(cfg, num_clients)
    return Prepared(cfg, alg, inputs, sample_stream(cfg.seed, num_clients, m, cfg.train.rounds), eval_mode,
                    spec_d.num_classes, counts, partition_summary(counts), cut, cut_name)


CLIENT_KEYS = ("bytes_up", "bytes_down", "flops", "steps", "t_end")


@dataclass
class History:
    """What the driver keeps across rounds (and checkpoints)."""

    rounds: list[int] = field(default_factory=list)  # evaluated rounds
    label_acc: list[list[float]] = field(default_factory=list)
    curves: dict[str, list] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    client_rows: list[list] = field(default_factory=list)  # per client per round accounting
    best_accuracy: float = 0.0
    rounds_to_target: int | None = None
    t_sim: float = 0.0
    wall: float = 0.0

    def add(self, key: str, rnd: int, value: float) -> None:
        self.curves.setdefault(key, []).append((rnd, float(value)))


def round_metrics(stats, prepared: Prepared) -> dict:
    cl = stats.clients.values()
    srv = stats.server
    losses = list(srv.get("losses", []))
    n_local = sum(c.get("loss_n", 0) for c in cl)
    train_loss = (float(np.mean(losses)) if losses else
                  (sum(c.get("loss_sum", 0) for c in cl) / n_local if n_local else float("nan")))
    gn_mean, gn_std = M.mean_std(srv.get("grad_norms", []))
    n = max(len(stats.clients), 1)
    up = sum(c.get("bytes_up", 0) for c in cl)
    down = sum(c.get("bytes_down", 0) for c in cl)
    return {
        "train_loss": train_loss, "grad_norm_mean": gn_mean, "grad_norm_std": gn_std,
        "sim_time_round": stats.sim_time, "sim_time": stats.t_end, "wall_time_round": stats.wall,
        "bytes_up": up, "bytes_down": down, "bytes_up_per_client": up / n, "bytes_down_per_client": down / n,
        "client_flops": sum(c.get("flops", 0) for c in cl), "server_flops": srv.get("flops", 0.0),
        "server_busy_s": srv.get("busy_wall", 0.0),
    }


def evaluate(rt: Runtime, prepared: Prepared, global_handle, clients) -> dict:
    if prepared.eval_mode == "global" and prepared.algorithm.evaluates_itself:
        y, p, loss = prepared.algorithm.evaluate(rt, global_handle)
    elif prepared.eval_mode == "global":
        y, p, loss = rt.evaluate_global(global_handle)
    else:
        who = range(len(prepared.inputs.test_idx)) if prepared.cfg.eval.clients == "all" else clients
        y, p, loss = rt.evaluate_clients(list(who))
    return M.classification_metrics(y, p, prepared.num_classes, loss_sum=loss)


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


def run_experiment(cfg: ExperimentConfig, resume_run_id: str | None = None,
                   on_round: Callable[[int, dict], None] | None = None) -> dict:
    """Run (or resume) one experiment tracked in MLflow. Returns the final metrics (plus ``run_id``)."""
    from raysplit.data import plot_partition
    from raysplit.tracking import Tracker, get_run

    ckpt_state = None
    if resume_run_id:
        run = get_run(resume_run_id, cfg.tracking.uri)
        path = run.data.tags.get("raysplit.checkpoint")
        if not path or not Path(path).is_file():
            raise ConfigError(f"run {resume_run_id} has no checkpoint to resume from (tag raysplit.checkpoint="
                              f"{path!r})")
        ckpt_state = torch.load(path, weights_only=False)
        from raysplit.config import validate
        import yaml

        cfg = validate(yaml.safe_load(ckpt_state["config"]))
    prepared = prepare(cfg)  # every config/data/model error is raised here, before any actor exists
    tcfg = cfg.tracking
    tracker = Tracker(tcfg.uri, tcfg.experiment, tcfg.run_name or cfg.name, run_id=resume_run_id,
                      enabled=tcfg.enabled)
    with tracker:
        out_dir = Path(tcfg.output_dir) / tracker.run_id
        out_dir.mkdir(parents=True, exist_ok=True)
        ckpt_path = (out_dir / "checkpoint.pt").resolve()
        if not resume_run_id:
            tracker.log_params(flatten(cfg.model_dump(mode="json")))
            tracker.log_params({"resolved.cut_index": prepared.cut, "resolved.cut_name": prepared.cut_name,
                                "resolved.clients_per_round": prepared.sample_stream.shape[1],
                                "resolved.num_clients": len(prepared.inputs.train_idx),
                                "resolved.eval_mode": prepared.eval_mode})
            tracker.log_params({f"resolved.{k}": v for k, v in prepared.algorithm.resolved().items()})
            tracker.log_params({f"partition.{k}": round(v, 6) for k, v in prepared.partition_summary.items()})
            cfg_file = out_dir / "config.yaml"
            cfg_file.write_text(dump(cfg))
            tracker.log_artifact(cfg_file)
            plot_partition(prepared.partition_counts, str(out_dir / "partition.png"),
                           title=f"{cfg.data.dataset} / {cfg.data.partition.name}")
            tracker.log_artifact(out_dir / "partition.png")
            np.savetxt(out_dir / "partition_counts.csv", prepared.partition_counts, fmt="%d", delimiter=",")
            tracker.log_artifact(out_dir / "partition_counts.csv")
        tracker.set_tags({"raysplit.algorithm": cfg.algorithm_name, "raysplit.checkpoint": ckpt_path})
        return _loop(cfg, prepared, tracker, out_dir, ckpt_path, ckpt_state, on_round)


def _loop(cfg, prepared, tracker, out_dir, ckpt_path, ckpt_state, on_round):
    alg = prepared.algorithm
    hist = History()
    start = 0
    rt = Runtime(make_backend(cfg.runtime), prepared.inputs, cfg.runtime.max_in_flight)
    try:
        if ckpt_state is not None:
            rt.load_state_dict(ckpt_state["runtime"])
            hist = ckpt_state["history"]
            start = ckpt_state["round"] + 1
            global_handle = ckpt_state.get("global")
            global_handle = rt.put(global_handle) if global_handle is not None else None
        else:
            global_handle = rt.put(_initial_global(prepared))
        progress = None
        if cfg.tracking.progress:
            from tqdm import tqdm

            progress = tqdm(total=cfg.train.rounds, initial=start, desc=f"{cfg.algorithm_name}", unit="round",
                            dynamic_ncols=True)
        final: dict = {}
        positions = alg.positions()
        t_wall0 = time.perf_counter() - hist.wall
        for rnd in range(start, cfg.train.rounds):
            clients = [int(c) for c in prepared.sample_stream[rnd]]
            rt.begin_round(rnd, clients, hist.t_sim)
            h = alg.run_round(rt, rnd, clients, np.random.default_rng([cfg.seed, rnd, 3]))
            if h is not None:
                global_handle = h
            stats = rt.end_round()
            hist.t_sim = stats.t_end
            hist.wall = time.perf_counter() - t_wall0
            m = round_metrics(stats, prepared)
            m["wall_time"] = hist.wall
            hist.grad_norms.extend(stats.server.get("grad_norms", []))
            hist.client_rows.extend([rnd, c] + [st.get(k, 0.0) for k in CLIENT_KEYS]
                                    for c, st in sorted(stats.clients.items()))
            last = rnd == cfg.train.rounds - 1
            if (rnd + 1) % cfg.eval.every == 0 or last:
                ev = evaluate(rt, prepared, global_handle, clients)
                la = ev.pop("label_accuracy")
                hist.rounds.append(rnd)
                hist.label_acc.append(la.tolist())
                ev["backward_transfer"] = M.backward_transfer(np.array(hist.label_acc))
                hist.best_accuracy = max(hist.best_accuracy, ev["accuracy"])
                ev["best_accuracy"] = hist.best_accuracy
                tgt = cfg.eval.target_accuracy
                if tgt is not None and hist.rounds_to_target is None and ev["accuracy"] >= tgt:
                    hist.rounds_to_target = rnd + 1
                if hist.rounds_to_target is not None:
                    ev["rounds_to_target"] = hist.rounds_to_target
                if len(la) <= 20:
                    ev.update({f"label_acc_{i}": a for i, a in enumerate(la) if not np.isnan(a)})
                if positions is not None:
                    ev.update({f"position_acc_{i}": a for i, a in enumerate(M.position_accuracy(la, positions))})
                m.update(ev)
                for k in ("accuracy", "loss", "f1_macro"):
                    hist.add(k, rnd, ev[k])
            hist.add("train_loss", rnd, m["train_loss"])
            tracker.log_metrics(m, step=rnd)
            final = m
            if on_round is not None:
                on_round(rnd, m)
            if progress is not None:
                progress.update(1)
                last_acc = hist.curves["accuracy"][-1][1] if hist.curves.get("accuracy") else float("nan")
                progress.set_postfix(acc=f"{last_acc:.3f}", loss=f"{m['train_loss']:.3f}",
                                     sim=f"{hist.t_sim:.1f}s")
            every = cfg.tracking.checkpoint_every
            if last or (every and (rnd + 1) % every == 0):
                _atomic_save({"round": rnd, "history": hist, "runtime": rt.state_dict(), "config": dump(cfg),
                              "global": rt.get(global_handle) if global_handle is not None else None}, ckpt_path)
        if progress is not None:
            progress.close()
        _finish(cfg, prepared, rt, tracker, hist, out_dir, ckpt_path)
        final.update(run_id=tracker.run_id, grad_norm_mean_all=M.mean_std(hist.grad_norms)[0],
                     grad_norm_std_all=M.mean_std(hist.grad_norms)[1])
        return final
    finally:
        rt.shutdown()


def _initial_global(prepared: Prepared):
    from raysplit.runtime.messages import StateMsg

    return StateMsg(prepared.inputs.client_init)


def _finish(cfg, prepared, rt, tracker, hist: History, out_dir: Path, ckpt_path: Path) -> None:
    from raysplit.plots import plot_curves, plot_label_heatmap

    gm, gs = M.mean_std(hist.grad_norms)
    summary = {"final_best_accuracy": hist.best_accuracy, "grad_norm_mean_all": gm, "grad_norm_std_all": gs,
               "sim_time_total": hist.t_sim, "wall_time_total": hist.wall}
    tracker.log_metrics(summary, step=cfg.train.rounds - 1)
    plot_curves(hist.curves, str(out_dir / "curves.png"), title=cfg.name)
    tracker.log_artifact(out_dir / "curves.png")
    if hist.rounds:
        plot_label_heatmap(hist.rounds, np.array(hist.label_acc), str(out_dir / "label_accuracy.png"))
        tracker.log_artifact(out_dir / "label_accuracy.png")
        with open(out_dir / "label_accuracy.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["round"] + [f"label_{i}" for i in range(prepared.num_classes)])
            for r, row in zip(hist.rounds, hist.label_acc):
                w.writerow([r] + row)
        tracker.log_artifact(out_dir / "label_accuracy.csv")
        positions = prepared.algorithm.positions()
        if positions is not None:
            from raysplit.plots import plot_positions

            pos_acc = M.position_accuracy(np.array(hist.label_acc), positions)
            plot_positions(hist.rounds, pos_acc, positions, str(out_dir / "position_accuracy.png"),
                           title=f"{cfg.name}: per-position accuracy")
            tracker.log_artifact(out_dir / "position_accuracy.png")
            with open(out_dir / "position_accuracy.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["round"] + [f"position_{i}_label_{lab}" for i, lab in enumerate(positions)])
                for r, row in zip(hist.rounds, pos_acc):
                    w.writerow([r] + row.tolist())
            tracker.log_artifact(out_dir / "position_accuracy.csv")
    with open(out_dir / "client_rounds.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "client", *CLIENT_KEYS])
        w.writerows(hist.client_rows)
    tracker.log_artifact(out_dir / "client_rounds.csv")
    totals = rt.client_totals()
    with open(out_dir / "client_accounting.csv", "w", newline="") as f:
        w = csv.writer(f)
        keys = ["rounds", "steps", "bytes_up", "bytes_down", "flops"]
        w.writerow(["client"] + keys)
        for c in sorted(totals):
            w.writerow([c] + [totals[c].get(k, 0) for k in keys])
    tracker.log_artifact(out_dir / "client_accounting.csv")
    if cfg.tracking.log_checkpoint_artifact and ckpt_path.is_file():
        tracker.log_artifact(ckpt_path)
