"""raysplit: split learning and split federated learning on Ray.

From Python (a notebook, a script): ``raysplit.run(config, **overrides)``, ``raysplit.sweep(path)`` and
``raysplit.compare(experiment)`` (:mod:`raysplit.pyapi`), loaded on first use so that ``import raysplit`` stays
light."""

from raysplit.version import __version__

_API = ("run", "sweep", "compare", "RunResult", "Comparison")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from raysplit import pyapi

        return getattr(pyapi, name)
    raise AttributeError(f"module 'raysplit' has no attribute {name!r}")
