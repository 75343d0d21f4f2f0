"""Errors every layer may raise. A module of its own, so that config, algorithms and runtime can share them
without importing each other."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key at fault and what is allowed."""


class ResourceError(RuntimeError):
    """The requested actors cannot be placed on this cluster (Ray would wait forever); names the resource, what
    was asked and what the cluster has."""


class ActorFailure(RuntimeError):
    """An actor of the run died (process killed, OOM, node lost) and the run could not go on; names the actor,
    its node and the round."""


class BadClientInput(RuntimeError):
    """An activation or gradient that fails the runtime's checks (non-finite values, wrong shape or dtype, labels
    out of range, a tag from another round) under ``runtime.faults.on_bad_client: fail``; names client, round and step."""
