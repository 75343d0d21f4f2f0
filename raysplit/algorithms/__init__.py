"""Algorithm registry. Importing this package registers every algorithm."""
# Relative imports: algorithm modules import nothing outside raysplit (and never Ray).

from .base import (ALGORITHMS, Algorithm, AlgorithmParams, AsyncAlgorithm, SetupInfo, algorithm_params,
                   get_algorithm, register)
from . import (ampere, asyncfl, baselines, cyclesl, gas, hydra, mergesfl, minibatch, semisfl, sflprox,  # noqa: F401
               sflvariants)

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmParams", "AsyncAlgorithm", "SetupInfo", "algorithm_params", "get_algorithm",
           "register"]
