"""How an algorithm calls host methods: ``rt.server.<name>(...)``, ``rt.workers.<name>(...)`` and
``rt.client(c).<name>(...)`` are :class:`HostCalls`, checked against the host class (and the method's rule) when the
attribute is looked up, so a misspelt call fails on the driver, naming class and method."""

from __future__ import annotations

from typing import Callable

from raysplit.runtime.rules import host_calls, rule_calls
from raysplit.runtime.server.stepping import u_shaped


class HostCalls:
    """Calls of one host class's methods, checked against the class when the attribute is looked up.

    ``targets`` gives the host handles the call goes to (one, or every worker for a fan-out), ``bind`` arguments
    put first (the client id for ``rt.client(c)``), ``returning`` the number of handles a list-returning server
    method is split into (one handle per element, so each client's gradient travels alone)."""

    def __init__(self, backend, host_cls: type, role: str, targets, *, bind: tuple = (), fan_out: bool = False,
                 returning: int | None = None, rule: type | None = None):
        self._backend, self._cls, self._role, self._targets = backend, host_cls, role, targets
        self._bind, self._fan_out, self._returning, self._rule = bind, fan_out, returning, rule

    def returning(self, n: int) -> "HostCalls":
        """The same calls, for a method that returns a list of ``n`` results: a list of ``n`` handles."""
        return HostCalls(self._backend, self._cls, self._role, self._targets, bind=self._bind, returning=n,
                         rule=self._rule)

    def __getattr__(self, name: str):
        known = set(host_calls(self._cls)) | set(rule_calls(self._rule) if self._rule else ())
        if name.startswith("_") or name not in known:
            raise AttributeError(f"{self._cls.__name__} (the {self._role} host) has no method {name!r}"
                                 + (f", nor has its rule {self._rule.__name__}" if self._rule else ""))
        b, args0 = self._backend, self._bind

        # a server method runs through ServerHost.serve, which screens the activations it is given
        via = ("serve", name) if self._role == "server" else (name,)

        def call(*args, **kwargs):
            if self._fan_out:
                return [b.call(h, *via, *args0, *args, **kwargs) for h in self._targets()]
            host = self._targets()
            if self._returning is not None:
                return b.call_n(host, self._returning, *via, *args0, *args, **kwargs)
            return b.call(host, *via, *args0, *args, **kwargs)

        call.__name__ = name
        return call


def step_name(step: Callable, host: type, rule: type, ushape=None, pooled: bool = False) -> str:
    """The name a server step travels under: ``step`` must be a method of the server ``host`` class or of the
    method's server ``rule``, given by reference (``ServerHost.train_copies``, ``CycleServer.cycle_step``), not by
    name (a TypeError says so, naming both classes). Under a U-shaped split (``ushape``) the step a loop runs
    instead (:func:`~raysplit.runtime.server.stepping.u_shaped`; ``pooled``: for pooled steps, which it refuses)."""
    name = step if isinstance(step, str) else getattr(step, "__name__", "")
    if (not any(vars(k).get(name) is step for k in (*host.__mro__, *rule.__mro__))  # its own or inherited
            or name not in set(host_calls(host)) | set(rule_calls(rule))):
        raise TypeError(f"server step {step!r}: give a method of {host.__name__} or {rule.__name__} by reference "
                        f"(e.g. {rule.__name__}.{name or 'my_step'}), not its name")
    return u_shaped(name, ushape, pooled)
