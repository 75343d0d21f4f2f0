"""raysplit: split learning and split federated learning on Ray."""

__version__ = "0.1.0"
