"""Algorithm registry. Importing this package imports every module in it, so each algorithm class that carries
``@register`` is found: a new method is a new module, with no import list to edit.
Relative imports: algorithm modules import nothing outside raysplit (and never Ray)."""

import importlib
import pkgutil

from .base import (ALGORITHMS, Algorithm, AlgorithmParams, AsyncAlgorithm, SetupInfo, algorithm_params,
                   get_algorithm, register)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmParams", "AsyncAlgorithm", "SetupInfo", "algorithm_params", "get_algorithm",
           "register"]
