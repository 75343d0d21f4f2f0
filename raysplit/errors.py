"""Errors every layer may raise. A module of its own, so that config, algorithms and runtime can share them
without importing each other."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key at fault and what is allowed."""
