"""Algorithm registry. Importing this package registers every algorithm."""

from raysplit.algorithms.base import ALGORITHMS, Algorithm, AlgorithmParams, algorithm_params, get_algorithm, register
from raysplit.algorithms import baselines, cyclesl  # noqa: F401  (registers)

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmParams", "algorithm_params", "get_algorithm", "register"]
