"""The server's screen of what arrives (``runtime.faults.on_bad_client``): the activations a call may use, the
clients dropped for the round (for their job, under events) and why."""

from __future__ import annotations

import inspect
from typing import Callable

import numpy as np
import torch

from raysplit.runtime import transport
from raysplit.runtime.messages import Activation, Gradient, Tag
from raysplit.runtime.screening import (ACTIVATION, Deferred, activation_form_fault, bad_input, defer_nonfinite, nonfinite_fault,
                                        screens_nonfinite, where_of)


class Screen:
    """The server's screening of what arrives (``runtime.faults.on_bad_client``): ``dropped`` holds the clients whose
    activations are withheld (for the round; for their job, under events) and why, ``drops`` this round's drops as
    "client c, round r, step s: why" (logged).

    An activation's form (round, shape, dtype, labels) is checked as it arrives. Its values (NaN or inf) are read
    then only where the screen must decide at once (``drop``: the client is left out from this step on) or where
    they are host memory (an activation that travelled); a tensor handed over in process under ``fail`` is
    counted on its device and judged with the round's other deferred checks (``deferred``, read once at the
    round's end, in order: the run fails naming the same client, round and step)."""

    def __init__(self, plan, encoder: Callable[[], torch.nn.Module], device, deferred: Deferred | None = None):
        self.plan, self.encoder, self.device = plan, encoder, device
        self.deferred = deferred
        self.on_bad_client = plan.sections.runtime.faults.on_bad_client
        self._forms: dict[int | None, tuple] = {}
        self._varargs: dict[str, bool] = {}
        self.dropped: dict[int, str] = {}
        self.drops: dict[int, str] = {}

    def new_round(self) -> None:
        self.drops = {}
        if not self.plan.method.asynchronous:  # under events a client stays dropped until its job ends
            self.dropped.clear()

    def form(self, cut: int | None = None) -> tuple[tuple, np.dtype]:
        """Per-sample shape and dtype of what the client part (``encoder()``) sends, probed once on zeros; ``cut``:
        a tiered client's, whose part is the encoder's first ``cut`` blocks."""
        if cut not in self._forms:
            enc = self.encoder() if cut is None else getattr(self.encoder(), "head", self.encoder())[:cut]
            mode = enc.training
            enc.eval()
            with torch.no_grad():
                model = self.plan.model
                kind = torch.long if model.inputs.kind == "tokens" else torch.float32  # token ids: integers
                out = enc(torch.zeros((2, *model.input_shape), dtype=kind, device=self.device))
            enc.train(mode)
            self._forms[cut] = (tuple(out.shape[1:]), np.dtype(transport.dtype_name(out)))
        return self._forms[cut]

    def check(self, act: Activation, rnd: int | None) -> str:
        """'' if ``act`` may be used; otherwise why not (:func:`activation_fault`; ``rnd``: the round it must
        carry). Under ``on_bad_client: fail`` a fault raises :class:`BadClientInput` naming client, round and step;
        under ``drop`` the client is dropped and its later activations are withheld too."""
        c = act.tag.client
        if c in self.dropped:
            return self.dropped[c]
        shape, dtype = self.form(self.plan.model.cut_of(c))
        why = activation_form_fault(act, shape, dtype, self.plan.model.num_classes, rnd,
                                    self.plan.model.label_shape)
        if not why and screens_nonfinite(self.plan):
            x = act.x
            if isinstance(x, torch.Tensor) and self.on_bad_client == "fail" and self.deferred is not None:
                tag = act.tag
                defer_nonfinite(self.deferred, x, "activation",
                                lambda w: bad_input(where_of(tag), f"activation rejected by the server: {w}"),
                                (tag.round, tag.step, ACTIVATION))
            else:  # read now: the client is dropped from this step on, or the values are in host memory
                why = nonfinite_fault(x, "activation")
        if not why:
            return ""
        if self.on_bad_client == "fail":
            raise bad_input(where_of(act.tag), f"activation rejected by the server: {why}")
        self.dropped[c] = why
        self.drops[c] = f"{where_of(act.tag)}: {why}"
        return why

    def call(self, fn: Callable, args: tuple, kwargs: dict, expected_round: Callable[[Tag], int | None],
             clock: float):
        """``fn(*args, **kwargs)`` with the activations among ``args`` checked first. With ``on_bad_client: drop``
        a rejected activation is answered with an empty gradient marked ``rejected`` (sent at ``clock``) and
        ``fn`` gets the others; every activation of a rejected client is withheld (its streams are paired). ``fn``
        returns one gradient per activation: a list when it takes ``*acts``."""
        pos = [i for i, a in enumerate(args) if isinstance(a, Activation)]
        bad = {}
        for i in pos:
            why = self.check(args[i], expected_round(args[i].tag))
            if why:
                bad[args[i].tag.client] = why
        if not bad:
            return fn(*args, **kwargs)
        keep = [a for a in args if not (isinstance(a, Activation) and a.tag.client in bad)]
        served = iter(fn(*keep, **kwargs) if len(keep) > len(args) - len(pos) else [])
        grads = [Gradient(args[i].tag, None, clock, rejected=bad[args[i].tag.client])
                 if args[i].tag.client in bad else next(served) for i in pos]
        name = fn.__name__
        if name not in self._varargs:
            self._varargs[name] = any(q.kind == q.VAR_POSITIONAL for q in inspect.signature(fn).parameters.values())
        return grads if self._varargs[name] else grads[0]
