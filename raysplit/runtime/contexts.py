"""What a method's rules see: a typed, read-only context, never the host (issue 69).

A rule (:mod:`raysplit.runtime.rules`) is built from one of these and keeps it as ``self.ctx``. A context holds
three kinds of thing, and nothing else:

- **the run's typed config sections**, as the config validated them: ``train``, ``eval``, ``clock``, ``runtime``,
  ``privacy`` (the privacy plug-ins as the driver checked them, :class:`~raysplit.privacy.PrivacySpec`, or None),
  ``seed``, and ``model`` (:class:`ModelFacts`: what the model is, where it is cut, what crosses the cut);
- **the method**: ``params`` (its validated ``Params``) and ``setup`` (what it derived on the driver before any
  actor started, ``Algorithm.host_setup``);
- **the components the rule may use**: on a client host its clients' ``data``, the cost ``meter``, the client
  ``states``, the ``executor``, the privacy plug-ins at the ``cut``, and three calls of the host's step
  (:meth:`ClientContext.activate`, :meth:`ClientContext.update`, :meth:`ClientContext.defend`); on the server the
  server ``models`` (main and copies), the ``trainer`` (the step arithmetic), the ``evaluation`` (the global test
  set) and the server's ``labeled`` set; under the event loop the ``global_model``. Both give seeded random
  generators (:meth:`rng`; a client's torch stream, :meth:`ClientContext.seeded`) and the current ``round``.

Setting an attribute of a context is an error: a rule keeps its own state on itself. The components are the
host's own objects (a rule that draws a batch advances the client's cursor), and a rule uses them through their
public methods only (tests/test_architecture.py reads the algorithms' syntax trees for ``self.host``)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from raysplit.runtime.plan import ModelFacts, Progress, Sections


class _Context:
    """A read-only bag of named things (the module docstring); ``names`` lists them."""

    __slots__ = ("_items",)

    def __init__(self, **items):
        object.__setattr__(self, "_items", items)

    def __getattr__(self, name: str):
        try:
            return self._items[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no {name!r}; it holds: "
                                 f"{', '.join(sorted(self.names()))}") from None

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only: a rule keeps its state on itself, not on its "
                             f"context (tried to set {name!r})")

    def __reduce__(self):  # a context is rebuilt by its host, never shipped
        raise TypeError(f"a {type(self).__name__} stays in its host's process")

    def names(self) -> list[str]:
        return [k for k in self._items if not k.startswith("_")] + [
            k for k in type(self).__dict__ if not k.startswith("_") and k != "names"]

    @property
    def round(self) -> int:
        """The host's current round (asynchronous clients: the round their job began in is the tag's)."""
        return self._items["_progress"].round

    @property
    def params(self):
        """The method's validated ``Params`` (the ``algorithm:`` section)."""
        return self._items["_method"].params

    @property
    def setup(self):
        """What the method derived on the driver before any actor started (``Algorithm.host_setup``)."""
        return self._items["_method"].setup

    def rng(self, *salt: int) -> np.random.Generator:
        """A numpy generator seeded from the run's seed and ``salt`` (``default_rng([seed, *salt])``): a rule's
        random choices repeat for the same seed wherever the rule runs."""
        return np.random.default_rng([self._items["seed"], *salt])


class ClientContext(_Context):
    """A client rule's context (the module docstring): sections, method, ``model``, and the client host's ``data``,
    ``meter``, ``states``, ``executor``, ``cut``, ``device``, with the host's ``activate``, ``update`` and
    ``defend``."""

    def seeded(self, cid: int, *salt: int):
        """A context manager: torch draws from a stream seeded per (client, ``salt``) inside it (dropout,
        augmentation), whatever host the client is on (the executor's :meth:`~Executor.seeded`)."""
        return self._items["executor"].seeded(cid, *salt)


class ServerContext(_Context):
    """A server rule's context (the module docstring): sections, method, ``model``, and the server's ``models``,
    ``trainer``, ``evaluation``, ``labeled``, ``device`` (and ``global_model`` under the event loop)."""


def client_context(*, sections: Sections, model: ModelFacts, method, privacy, progress: Progress, data, meter,
                   states, executor, cut, activate: Callable, update: Callable, defend: Callable) -> ClientContext:
    """The context of a client host's rule."""
    s = sections
    return ClientContext(train=s.train, eval=s.eval, clock=s.clock, runtime=s.runtime, seed=s.seed, privacy=privacy,
                         model=model, data=data, meter=meter, states=states, executor=executor, cut=cut,
                         device=executor.device, activate=activate, update=update, defend=defend,
                         _method=method, _progress=progress)


def server_context(*, sections: Sections, model: ModelFacts, method, privacy, progress: Progress, models, trainer,
                   evaluation, labeled: dict, device, **more) -> ServerContext:
    """The context of the server host's rule (``more``: what a kind of server host adds, the event loop's
    ``global_model``)."""
    s = sections
    return ServerContext(train=s.train, eval=s.eval, clock=s.clock, runtime=s.runtime, seed=s.seed, privacy=privacy,
                         model=model, models=models, trainer=trainer, evaluation=evaluation, labeled=labeled,
                         device=device, _method=method, _progress=progress, **more)
