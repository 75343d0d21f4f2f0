"""Stand-in for ``wandb`` (Weights & Biases) for the CycleSL parity runner: the package is not installed here and
would need an account or network. Their code calls only ``wandb.init(...)`` (main.py) and ``wandb.log(dict)``
(models.eval_help, once before training and once after every round). This module keeps every logged dict in
``LOGS`` (tensors as floats) and calls ``HOOK(index, entry)`` after each, where the runner's driver evaluates all
clients (benchmarks/peers/cyclesl/_driver.py). Copied into the temporary copy of their repository by run.py.
"""

LOGS = []
CONFIG = {}
HOOK = None


def init(*args, **kwargs):
    CONFIG.update(kwargs.get("config") or {})
    return None


def _plain(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def log(entry, *args, **kwargs):
    row = {k: _plain(v) for k, v in dict(entry).items()}
    LOGS.append(row)
    if HOOK is not None:
        HOOK(len(LOGS) - 1, row)
