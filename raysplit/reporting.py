"""Reporting: what a run records about itself. Per round: training metrics from the round's counters,
evaluation when due (dispatched to the algorithm's ``evaluate`` hook), the metric history; at the start: params,
resolved config and partition artifacts; at the end: summary metrics, curves, heatmaps and accounting CSVs.
Everything goes through a :class:`~raysplit.tracking.Tracker` (MLflow, or nothing when tracking is off)."""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from raysplit import metrics as M
from raysplit.config import dump, flatten
from raysplit import tags

CLIENT_KEYS = ("bytes_up", "bytes_down", "flops", "steps", "t_end")
BYTE_KINDS = ("bytes_up_activations", "bytes_up_model", "bytes_up_labels", "bytes_down_gradients", "bytes_down_model")
U_BYTE_KINDS = ("bytes_down_middle", "bytes_up_tail_gradients")  # a U-shaped split's extra exchange (only then)
LABEL_SCORES = ("label_auc_norm", "label_auc_direction", "label_acc_direction", "label_acc_norm",
                "next_token_leak", "next_token_top5")


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
    last_round: int = -1  # the last round recorded (early stopping ends a run before train.rounds)

    def add(self, key: str, rnd: int, value: float) -> None:
        self.curves.setdefault(key, []).append((rnd, float(value)))


def round_metrics(stats) -> dict:
    """Training metrics of one round from its counters (``RoundStats``)."""
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
        "server_busy_s": srv.get("busy_wall", 0.0), **srv.get("metrics", {}),
        **{k: sum(c.get(k, 0) for c in cl) for k in BYTE_KINDS},  # the traffic by what it carries
        **({"privacy/epsilon": max(c["dp_epsilon"] for c in cl if "dp_epsilon" in c)}  # the round's most spent
           if any("dp_epsilon" in c for c in cl) else {}),
        **{k: sum(c.get(k, 0) for c in cl) for k in U_BYTE_KINDS if any(k in c for c in cl)},
        # the label attack's scores of the round, averaged over the clients that were scored
        **{f"privacy/{k}": float(np.mean([c[k] for c in cl if k in c])) for k in LABEL_SCORES
           if any(k in c for c in cl)},
    }


def tier_metrics(stats, cuts) -> dict:
    """Per tier of a run whose clients have their own cuts (``cuts[c]``; tier 0 the shallowest): the round's bytes
    up and down, client FLOPs and the latest clock of its clients (``comm/tier{k}/...``, ``compute/tier{k}/...``,
    ``time/tier{k}/...``)."""
    out = {}
    for k, cut in enumerate(sorted(set(cuts))):
        rows = [r for c, r in stats.clients.items() if cuts[int(c)] == cut]
        if not rows:
            continue
        out.update({f"comm/tier{k}/bytes_up": sum(r.get("bytes_up", 0) for r in rows),
                    f"comm/tier{k}/bytes_down": sum(r.get("bytes_down", 0) for r in rows),
                    f"compute/tier{k}/client_flops": sum(r.get("flops", 0) for r in rows),
                    f"time/tier{k}/sim_time": max(r.get("t_end", 0.0) for r in rows)})
    return out


def tier_evaluation(rt, prepared, global_handle, who: list[int], cuts) -> dict:
    """``eval/tier{k}/accuracy`` and ``loss`` of the clients at each cut (``eval.mode: clients``: each through its
    own part; a global model is one model at every cut once its blocks are aggregated, so it has no tiers); a
    language model's ``eval/tier{k}/perplexity``, ``loss`` (per token) and ``next_token_accuracy``."""
    out = {}
    lm = prepared.inputs.plan.model.language_model
    if prepared.eval_mode != "clients":
        return out
    for k, cut in enumerate(sorted(set(cuts))):
        mine = [c for c in who if cuts[int(c)] == cut]
        if not mine:
            continue
        y, p, loss = prepared.algorithm.evaluate(rt, prepared.eval_mode, global_handle, mine)
        if len(y) and lm:
            from raysplit.lm_metrics import lm_eval_metrics

            ev = lm_eval_metrics(y, p, loss)
            out.update({f"eval/tier{k}/{m}": ev[m] for m in ("perplexity", "loss", "next_token_accuracy")})
        elif len(y):
            ev = M.classification_metrics(y, p, prepared.num_classes, loss_sum=loss)
            out.update({f"eval/tier{k}/accuracy": ev["accuracy"], f"eval/tier{k}/loss": ev["loss"]})
    return out


def dropped_clients(stats) -> dict[int, str]:
    """The clients dropped in a round (``runtime.faults.on_bad_client: drop``) and why: rejected by the server, or
    rejecting the server's gradient."""
    out = {int(c): str(w) for c, w in stats.server.get("dropped", {}).items()}
    for c, st in stats.clients.items():
        if "drop_reason" in st and int(c) not in out:
            out[int(c)] = f"client {c}, round {stats.round}: {st['drop_reason']}"
    return out


def evaluation_clients(cfg, num_test_clients: int, participants: list[int]) -> list[int]:
    """Whose test splits ``eval.mode=clients`` uses: the round's participants, or every client."""
    return list(range(num_test_clients)) if cfg.eval.clients == "all" else list(participants)


def evaluate(rt, prepared, global_handle, clients) -> dict:
    """Classification metrics of the algorithm's evaluation (``Algorithm.evaluate``) in the run's eval mode; a
    language model's per-token loss and perplexity (:func:`raysplit.lm_metrics.lm_eval_metrics`)."""
    who = evaluation_clients(prepared.cfg, len(prepared.inputs.test_idx), clients)
    y, p, loss = prepared.algorithm.evaluate(rt, prepared.eval_mode, global_handle, who)
    if prepared.inputs.plan.model.language_model:
        from raysplit.lm_metrics import lm_eval_metrics

        return lm_eval_metrics(y, p, loss)
    return M.classification_metrics(y, p, prepared.num_classes, loss_sum=loss)


def validation(rt, prepared) -> dict:
    """``eval.validation``: every client's held-out split through the model ``eval.mode=clients`` evaluates (each
    client's current one), as a validation set beside the global test set: ``validation_accuracy`` and
    ``validation_loss`` (a language model: ``validation_perplexity`` and ``validation_loss``, per token)."""
    who = list(range(len(prepared.inputs.test_idx)))
    y, p, loss = prepared.algorithm.evaluate(rt, "clients", None, who)
    if prepared.inputs.plan.model.language_model:
        from raysplit.lm_metrics import lm_eval_metrics

        ev = lm_eval_metrics(y, p, loss)
        return {"validation_perplexity": ev["perplexity"], "validation_loss": ev["loss"]}
    ev = M.classification_metrics(y, p, prepared.num_classes, loss_sum=loss)
    return {"validation_accuracy": ev["accuracy"], "validation_loss": ev["loss"]}


def best_validated(curves: dict, language_model: bool) -> dict:
    """Model selection on validation (``eval.validation``): the first evaluation with the best validation score
    (highest accuracy; a language model's lowest perplexity) and the test metric there, as an early stop that
    restores its best-validated model reports it; empty without a validation curve. The round is counted from 0,
    as MLflow's steps and every round raysplit names (docs/usage.md); the study records under docs/results number
    rounds trained (from 1), so ``_runs.early_stop`` names the same evaluation one higher."""
    key, test = ("validation_perplexity", "perplexity") if language_model else ("validation_accuracy", "accuracy")
    val, at = curves.get(key, []), dict(curves.get(test, []))
    if not val:
        return {}
    best = (min if language_model else max)(val, key=lambda pt: pt[1])  # the first of equal bests
    return {"summary/best_validation_round": best[0], f"summary/{test}_at_best_validation": at[best[0]]}


class Reporter:
    """Records one run: ``start`` (new runs), ``record`` after every round, ``finish`` at the end."""

    def __init__(self, prepared, tracker, out_dir: Path, history: History | None = None,
                 on_round: Callable[[int, dict], None] | None = None):
        self.prepared = prepared
        self.cfg = prepared.cfg
        self.tracker = tracker
        self.out_dir = out_dir
        self.hist = history or History()
        self.on_round = on_round
        self.final: dict = {}
        self.positions = prepared.algorithm.positions()
        self._wall0 = time.perf_counter() - self.hist.wall
        self.progress = None
        # per metric key, the last step already in the tracking store (a resumed run, a round redone after an
        # actor died): those rounds are recomputed, identical, but a key is never logged twice for one step
        self.logged: dict[str, int] = tracker.last_steps() if history is not None else {}
        # the last round handed to ``on_round`` (Tune's report, a caller's callback): not undone by ``restore``,
        # so a round redone after it was reported (an actor that died after the run's last round) is not reported
        # twice; its metrics are those already reported (a redone round reproduces them)
        self.delivered = -1

    def begin(self) -> None:
        """The rounds start now (the runtime is up): wall time counts from here, the progress bar appears."""
        self._wall0 = time.perf_counter() - self.hist.wall
        if self.cfg.tracking.progress:
            from tqdm.auto import tqdm  # a notebook's progress bar where one runs (raysplit.run), else the terminal's

            self.progress = tqdm(total=self.cfg.train.rounds, initial=len(self.hist.curves.get("train_loss", [])),
                                 desc=f"{self.cfg.algorithm_name}, rounds done", unit="round", dynamic_ncols=True)

    def start(self) -> None:
        """Params (config flattened, resolved values, partition statistics) and the start-of-run artifacts."""
        from raysplit.data import plot_partition

        cfg, p, tr, out = self.cfg, self.prepared, self.tracker, self.out_dir
        tr.log_params(flatten(cfg.model_dump(mode="json")))
        tr.log_params({"resolved.cut_index": p.cut, "resolved.cut_name": p.cut_name,
                       "resolved.clients_per_round": p.sample_stream.shape[1],
                       "resolved.num_clients": len(p.inputs.train_idx), "resolved.eval_mode": p.eval_mode})
        tr.log_params({f"resolved.{k}": v for k, v in p.algorithm.resolved().items()})
        tr.log_params({f"partition.{k}": round(v, 6) for k, v in p.partition_summary.items()})
        cfg_file = out / "config.yaml"
        cfg_file.write_text(dump(cfg))
        tr.log_artifact(cfg_file)
        plot_partition(p.partition_counts, str(out / "partition.png"),
                       title=f"{cfg.data.dataset} / {cfg.data.partition.name}")
        tr.log_artifact(out / "partition.png")
        np.savetxt(out / "partition_counts.csv", p.partition_counts, fmt="%d", delimiter=",")
        tr.log_artifact(out / "partition_counts.csv")
        if p.text is not None:  # a language model's tokenizer (a BPE trained on the training split, or the model's)
            tr.log_artifact(p.text.tokenizer.save(out / "tokenizer"), "tokenizer")

    def record(self, rnd: int, stats, rt, global_handle, last: bool) -> dict:
        """Metrics of round ``rnd``: training counters, evaluation when due (and after the ``last`` round),
        history; logged at step ``rnd``."""
        cfg, hist = self.cfg, self.hist
        hist.t_sim = stats.t_end
        hist.wall = time.perf_counter() - self._wall0
        m = round_metrics(stats)
        cuts = self.prepared.inputs.plan.model.cuts  # clients with their own cuts: the numbers per tier too
        if cuts is not None:
            m.update(tier_metrics(stats, cuts))
        m["wall_time"] = hist.wall
        if self.prepared.text is not None:  # tokens trained (the blocks drawn, every token), per second, per byte
            from raysplit.lm_metrics import throughput_metrics

            blocks = sum(c.get("samples", 0) for c in stats.clients.values())
            m.update(throughput_metrics(blocks * cfg.data.text.context_length, stats.wall,
                                        m["bytes_up"] + m["bytes_down"]))
        hist.grad_norms.extend(stats.server.get("grad_norms", []))
        hist.client_rows.extend([rnd, c] + [st.get(k, 0.0) for k in CLIENT_KEYS]
                                for c, st in sorted(stats.clients.items()))
        if (rnd + 1) % cfg.eval.every == 0 or last:
            m.update(self._evaluation(rnd, rt, global_handle, stats.participants))
            if cuts is not None:
                who = evaluation_clients(cfg, len(self.prepared.inputs.test_idx), stats.participants)
                m.update(tier_evaluation(rt, self.prepared, global_handle, who, cuts))
            if cfg.privacy.attack.kind != "none":
                m.update(self._attack(rnd, rt, global_handle))
        hist.add("train_loss", rnd, m["train_loss"])
        hist.last_round = rnd
        dropped = dropped_clients(stats) if cfg.runtime.faults.on_bad_client == "drop" else None
        if dropped is not None:
            m["dropped_clients"] = len(dropped)
        train_loss = m["train_loss"]
        m = M.grouped(m)  # the names a run's metrics leave it with (eval/accuracy, comm/bytes_up, ...)
        if "privacy/epsilon" in self.final:  # the most any client has spent so far, also in a round it sat out
            m["privacy/epsilon"] = max(m.get("privacy/epsilon", 0.0), self.final["privacy/epsilon"])
        todo = {k: v for k, v in m.items() if self.logged.get(k, -1) < rnd}
        if todo:
            self.tracker.log_metrics(todo, step=rnd)
            if dropped and "train/dropped_clients" in todo:
                self.tracker.set_tags({tags.dropped(rnd): "; ".join(dropped.values())[:4000]})
            self.logged.update(dict.fromkeys(todo, rnd))
        self.final = m
        if self.on_round is not None and rnd > self.delivered:
            self.on_round(rnd, m)
            self.delivered = rnd
        if self.progress is not None:
            self.progress.update(1)
            # The last evaluated accuracy, kept between evaluations; none shown before the first one.
            evaluated = hist.curves.get("accuracy")
            self.progress.set_postfix(**({"acc": f"{evaluated[-1][1]:.3f}"} if evaluated else {}),
                                      loss=f"{train_loss:.3f}", sim=f"{hist.t_sim:.1f}s")
        return m

    _LISTS = ("rounds", "label_acc", "grad_norms", "client_rows")  # History's append-only lists
    _SCALARS = ("best_accuracy", "rounds_to_target", "t_sim", "wall", "last_round")

    def snapshot(self) -> dict:
        """What ``record`` changes, to undo a round that is redone (``RoundGuard``). The History only grows, so
        its lengths and scalars are enough: taken before every round, this must not copy the whole run."""
        h = self.hist
        return {"lists": {k: len(getattr(h, k)) for k in self._LISTS},
                "curves": {k: len(v) for k, v in h.curves.items()},
                "scalars": {k: getattr(h, k) for k in self._SCALARS}, "final": dict(self.final),
                "progress": self.progress.n if self.progress is not None else 0}

    def restore(self, snap: dict) -> None:
        h = self.hist
        for k, n in snap["lists"].items():
            del getattr(h, k)[n:]
        h.curves = {k: v[:snap["curves"][k]] for k, v in h.curves.items() if k in snap["curves"]}
        for k, v in snap["scalars"].items():
            setattr(h, k, v)
        self.final = dict(snap["final"])
        if self.progress is not None:
            self.progress.n = snap["progress"]
            self.progress.refresh()

    def _evaluation(self, rnd: int, rt, global_handle, participants) -> dict:
        hist = self.hist
        ev = evaluate(rt, self.prepared, global_handle, participants)
        if self.cfg.eval.validation:
            val = validation(rt, self.prepared)
            ev.update(val)  # its keys are its own (validation_*): the test metrics below leave them alone
            for k, v in val.items():
                if k != "validation_loss":
                    hist.add(k, rnd, v)
        if "perplexity" in ev:  # a language model: no per-label metrics (its labels are a vocabulary)
            for k in ("loss", "perplexity"):
                hist.add(k, rnd, ev[k])
            ev.update(self._generation(rnd, rt, global_handle, participants))
            return ev
        la = ev.pop("label_accuracy")
        hist.rounds.append(rnd)
        hist.label_acc.append(la.tolist())
        ev["backward_transfer"] = M.backward_transfer(np.array(hist.label_acc))
        hist.best_accuracy = max(hist.best_accuracy, ev["accuracy"])
        ev["best_accuracy"] = hist.best_accuracy
        tgt = self.cfg.eval.target_accuracy
        if tgt is not None and hist.rounds_to_target is None and ev["accuracy"] >= tgt:
            hist.rounds_to_target = rnd + 1
        if hist.rounds_to_target is not None:
            ev["rounds_to_target"] = hist.rounds_to_target
        if len(la) <= 20:
            ev.update({f"label_acc_{i}": a for i, a in enumerate(la) if not np.isnan(a)})
        if self.positions is not None:
            ev.update({f"position_acc_{i}": a for i, a in enumerate(M.position_accuracy(la, self.positions))})
        for k in ("accuracy", "loss", "f1_macro"):
            hist.add(k, rnd, ev[k])
        return ev

    def _generation(self, rnd: int, rt, global_handle, participants) -> dict:
        """A language model's samples at an evaluation (``data.text.generation``): the held-out prompts continued
        by one client (the round's first participant; it tokenizes the prompts and decodes the text itself)
        through its client part (the global model in ``eval.mode=global``, else its own) and the server's, logged
        as ``generations/round_NNN.json``; on E2E data scored against the MRs' references (``eval/bleu``,
        ``eval/rouge_l``: :func:`raysplit.lm_metrics.generation_scores`, over these prompts only)."""
        import json

        text, gen = self.prepared.text, self.cfg.data.text.generation
        if not text.prompts or gen.prompts == 0:
            return {}
        client = int(participants[0]) if len(participants) else 0
        seed = int(np.random.SeedSequence([gen.seed, rnd]).generate_state(1)[0])  # a draw per round, by the seed
        settings = {"max_new_tokens": gen.max_new_tokens, "greedy": gen.mode == "greedy",
                    "temperature": gen.temperature, "top_k": gen.top_k, "seed": seed}
        outputs = rt.get(rt.client(client).generate(  # on the worker hosting the client (ClientHost.generate)
            rt.server.get_state(), [p.prompt for p in text.prompts], text.tokenizer, settings,
            global_handle if self.prepared.eval_mode == "global" else None))
        out: dict = {}
        if self.cfg.data.text.corpus == "e2e":
            from raysplit.lm_metrics import generation_scores

            out = generation_scores(outputs, [p.references for p in text.prompts])
        record = {"round": rnd, "client": client, **settings, "scores": out,
                  "samples": [{"prompt": p.prompt, "generated": g, "references": list(p.references),
                               "source": p.source} for p, g in zip(text.prompts, outputs)]}
        path = self.out_dir / "generations" / f"round_{rnd:03d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False))
        self.tracker.log_artifact(path, "generations")
        return out

    def _attack(self, rnd: int, rt, global_handle) -> dict:
        """The attack's scores, averaged over its victims (``privacy/ssim``, ``psnr``, ``mse``, ``dcor``; on a
        language model ``privacy/token_recovery``); the
        last evaluation's (input, reconstruction) pairs are kept for the end-of-run grid."""
        per = rt.reconstruction(list(self.prepared.inputs.plan.privacy.victims), rnd, global_handle)
        self.reconstructions = [per[c]["images"] for c in sorted(per) if "images" in per[c]]
        keys = next(iter(per.values()), {})  # a language model's attack scores token_recovery instead
        return {f"privacy/{k}": float(np.mean([per[c][k] for c in per])) for k in keys if k != "images"}

    def finish(self, totals: dict[int, dict], ckpt_path: Path) -> dict:
        """Summary metrics and the end-of-run artifacts; returns the last round's metrics plus ``run_id``."""
        from raysplit.plots import plot_curves, plot_label_heatmap, plot_positions

        if self.progress is not None:
            self.progress.close()
        cfg, hist, tr, out = self.cfg, self.hist, self.tracker, self.out_dir
        gm, gs = M.mean_std(hist.grad_norms)
        # the best evaluation: a classifier's highest accuracy, a language model's lowest perplexity (it has no
        # accuracy; its best_accuracy would be a meaningless 0)
        if self.prepared.inputs.plan.model.language_model:
            ppl = [v for _, v in hist.curves.get("perplexity", [])]
            best = {"summary/best_perplexity": min(ppl)} if ppl else {}
        else:
            best = {"summary/best_accuracy": hist.best_accuracy}
        selected = best_validated(hist.curves, self.prepared.inputs.plan.model.language_model)
        best.update(selected)
        tr.log_metrics({**best, "summary/grad_norm_mean": gm, "summary/grad_norm_std": gs,
                        "summary/sim_time": hist.t_sim, "summary/wall_time": hist.wall}, step=hist.last_round)
        plot_curves(hist.curves, str(out / "curves.png"), title=cfg.name)
        tr.log_artifact(out / "curves.png")
        if hist.rounds:
            plot_label_heatmap(hist.rounds, np.array(hist.label_acc), str(out / "label_accuracy.png"))
            tr.log_artifact(out / "label_accuracy.png")
            self._csv("label_accuracy.csv", ["round"] + [f"label_{i}" for i in range(self.prepared.num_classes)],
                      ([r] + row for r, row in zip(hist.rounds, hist.label_acc)))
            if self.positions is not None:
                pos_acc = M.position_accuracy(np.array(hist.label_acc), self.positions)
                plot_positions(hist.rounds, pos_acc, self.positions, str(out / "position_accuracy.png"),
                               title=f"{cfg.name}: per-position accuracy")
                tr.log_artifact(out / "position_accuracy.png")
                self._csv("position_accuracy.csv",
                          ["round"] + [f"position_{i}_label_{lab}" for i, lab in enumerate(self.positions)],
                          ([r] + row.tolist() for r, row in zip(hist.rounds, pos_acc)))
        if getattr(self, "reconstructions", None):
            from raysplit.plots import plot_reconstructions

            plot_reconstructions(self.reconstructions, str(out / "reconstructions.png"),
                                 title=f"{cfg.name}: inputs (top) and the server's reconstructions, round "
                                       f"{hist.last_round}")
            tr.log_artifact(out / "reconstructions.png")
        self._csv("client_rounds.csv", ["round", "client", *CLIENT_KEYS], hist.client_rows)
        keys = ["rounds", "steps", "bytes_up", "bytes_down", "flops", *BYTE_KINDS, "t_last"]
        self._csv("client_accounting.csv", ["client"] + keys,
                  ([c] + [totals[c].get(k, 0) for k in keys] for c in sorted(totals)))
        if cfg.tracking.log_checkpoint_artifact and ckpt_path.is_file():
            tr.log_artifact(ckpt_path)
        return {**self.final, **selected, "run_id": tr.run_id, "summary/grad_norm_mean": gm,
                "summary/grad_norm_std": gs}

    def _csv(self, name: str, header: list, rows) -> None:
        with open(self.out_dir / name, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(rows)
        self.tracker.log_artifact(self.out_dir / name)
