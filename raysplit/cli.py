"""Command line: ``raysplit run``, ``list``, ``sweep``, ``compare``, ``replay``."""

from __future__ import annotations

import argparse
import sys


def _cmd_run(args) -> int:
    from raysplit.config import load_config
    from raysplit.experiment import run_experiment

    if args.resume:
        from raysplit.config import ExperimentConfig

        cfg = load_config(args.config, args.overrides) if args.config else ExperimentConfig()
        final = run_experiment(cfg, resume_run_id=args.resume)
    else:
        if not args.config:
            print("raysplit run: give a CONFIG file (or --resume RUN_ID)", file=sys.stderr)
            return 2
        final = run_experiment(load_config(args.config, args.overrides))
    keys = ("eval/accuracy", "eval/f1_macro", "eval/mcc", "eval/loss", "time/sim", "time/wall")
    print("run", final["run_id"], " ".join(f"{k}={final[k]:.4f}" for k in keys if k in final))
    return 0


def _cmd_list(args) -> int:
    from raysplit.algorithms import ALGORITHMS
    from raysplit.data import DATASETS, PARTITIONERS
    from raysplit.models import MODELS

    if args.algorithm == "config":
        from raysplit.config_doc import reference

        print(reference(), end="")
        return 0
    if args.algorithm:
        if args.algorithm not in ALGORITHMS:
            print(f"raysplit list: unknown algorithm {args.algorithm!r}; registered: "
                  f"{', '.join(sorted(ALGORITHMS))}", file=sys.stderr)
            return 2
        a = ALGORITHMS[args.algorithm]
        print(f"{a.name}: {a.description}\n\n{(a.__doc__ or '').strip()}\n\nparameters (algorithm.<key>):")
        for key, default, desc in a.param_docs() or [("(none)", "", "")]:
            print(f"  {key:<20} {default:<12} {desc}")
        return 0
    print("algorithms (raysplit list ALGORITHM: its parameters in full):")
    for n, a in sorted(ALGORITHMS.items()):
        print(f"  {n:<14} {a.description}")
        for key, default, desc in a.param_docs():
            print(f"      {key} = {default}: {desc}")
    print("models:")
    for n, m in sorted(MODELS.items()):
        print(f"  {n:<20} input {tuple(m.default_input_shape)}, default cut {m.default_cut!r}")
    print("datasets:")
    for n in sorted(DATASETS):
        print(f"  {n}")
    print("partitioners:")
    for n in sorted(PARTITIONERS):
        print(f"  {n}")
    from raysplit.label_privacy import LABEL_ATTACK_MODELS, LABEL_DEFENCE_MODELS
    from raysplit.privacy import ATTACK_PLUGINS, ATTACKS, DEFENCE_MODELS, NoAttack

    sections = (("privacy defences (privacy.defence.kind)", DEFENCE_MODELS, None),
                ("privacy attacks (privacy.attack.kind)", (NoAttack, *(a.Params for a in ATTACK_PLUGINS.values())),
                 ATTACKS),
                ("label defences, U-shaped splits (privacy.label_defence.kind)", LABEL_DEFENCE_MODELS, None),
                ("label attacks, U-shaped splits (privacy.label_attack.kind)", LABEL_ATTACK_MODELS, None))
    for title, models, descriptions in sections:
        print(f"{title}:")
        for name, desc, params in plugin_docs(models, descriptions):
            print(f"  {name:<18} {desc}")
            for key, default, pdesc in params:
                print(f"      {key} = {default}: {pdesc}")
    return 0


def plugin_docs(models, descriptions: dict | None = None) -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """``(kind, description, [(key, default, description)])`` of each privacy plug-in's config model (its
    ``kind`` field names and describes it unless ``descriptions`` has its own line; its other fields are its
    parameters)."""
    out = []
    for m in models:
        kind = m.model_fields["kind"]
        name = kind.annotation.__args__[0]
        desc = (descriptions or {}).get(name) or (kind.description or "").split(": ", 1)[-1]
        params = [(k, "required" if f.is_required() else repr(f.default), f.description or "")
                  for k, f in m.model_fields.items() if k != "kind"]
        out.append((name, desc, params))
    return out


def _cmd_compare(args) -> int:
    from raysplit.comparison import compare_runs

    print(compare_runs(args.experiment, uri=args.tracking_uri, metric=args.metric, plot=args.plot,
                       against=args.against))
    return 0


def _cmd_sweep(args) -> int:
    from raysplit.tuning import run_sweep

    run_sweep(args.sweep, args.overrides)
    return 0


def _cmd_replay(args) -> int:
    from raysplit.tracking import replay

    try:
        n = replay(args.spool, args.tracking_uri)
    except FileNotFoundError as e:
        print(f"raysplit replay: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the store is still down: the file keeps what was not delivered
        print(f"raysplit replay: stopped ({type(e).__name__}: {str(e)[:300]}); the calls not yet delivered stay in "
              f"{args.spool}, run this again later", file=sys.stderr)
        return 1
    print(f"delivered {n} call(s) from {args.spool}; the spool file is removed")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raysplit", description="split learning on Ray")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run an experiment from a YAML config")
    r.add_argument("config", nargs="?", help="YAML config file")
    r.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.rounds=5")
    r.add_argument("--resume", metavar="RUN_ID", help="continue an MLflow run from its last checkpoint")
    r.set_defaults(fn=_cmd_run)
    ls = sub.add_parser("list", help="algorithms (with their parameters), models, datasets, partitioners, "
                        "privacy defences and attacks")
    ls.add_argument("algorithm", nargs="?", help="show one algorithm's parameters, defaults and descriptions; "
                    "'config': every config key with its type, default and description (docs/config.md)")
    ls.set_defaults(fn=_cmd_list)
    sw = sub.add_parser("sweep", help="Ray Tune sweep from a sweep YAML (see raysplit/tuning.py)")
    sw.add_argument("sweep")
    sw.add_argument("overrides", nargs="*", help="dotted overrides applied to the base config")
    sw.set_defaults(fn=_cmd_sweep)
    c = sub.add_parser("compare", help="table of an MLflow experiment's runs and their final metrics")
    c.add_argument("experiment")
    c.add_argument("--metric", default="eval/accuracy", help="a metric's grouped name (an old short name, e.g. "
                   "accuracy, is read as its grouped one)")
    c.add_argument("--plot", default=None, help="write an overlay plot of the per-round metric to this PNG")
    c.add_argument("--against", default=None, help="a second metric: a column, and --plot draws each run's final "
                   "--metric against it (e.g. privacy/ssim: accuracy against leakage)")
    c.add_argument("--tracking-uri", default=None)
    c.set_defaults(fn=_cmd_compare)
    rp = sub.add_parser("replay", help="deliver a run's spooled MLflow calls (mlflow-spool.jsonl) to the store")
    rp.add_argument("spool")
    rp.add_argument("--tracking-uri", default=None, help="default: the store the run was logging to")
    rp.set_defaults(fn=_cmd_replay)
    args = p.parse_args(argv)
    from raysplit.data import DatasetNotFoundError
    from raysplit.errors import ActorFailure, BadClientInput, ConfigError, ResourceError
    from raysplit.runtime import NonFiniteLossError

    try:
        return args.fn(args)
    except (ConfigError, DatasetNotFoundError) as e:  # bad input: one clear message, nothing started
        print(f"raysplit: {e}", file=sys.stderr)
        return 2
    except (NonFiniteLossError, BadClientInput) as e:
        print(f"raysplit: run stopped: {e}", file=sys.stderr)
        return 1
    except (ResourceError, ActorFailure) as e:
        print(f"raysplit: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
