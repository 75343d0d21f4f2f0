"""The privacy plug-ins on a client host's side of the cut (``privacy``): the defence applied to what leaves
(:class:`~raysplit.privacy.CutDefence`: noise with its accountant, quantization, NoPeek's loss term) and the
attack the server would run on what it receives (:data:`~raysplit.privacy.ATTACK_PLUGINS`), scored here because
the score needs the inputs the attacker never sees."""

from __future__ import annotations

import numpy as np
import torch

from raysplit.data import to_tensor
from raysplit.privacy import ATTACK_PLUGINS, AttackView, CutDefence, distance_correlation, reconstruction_scores
from raysplit.runtime import transport
from raysplit.runtime.state import ModelSlot
from raysplit.runtime.messages import StateMsg, Tag


class ClientCut:
    """``defence``: the configured defence (None: off). NoPeek keeps each forward's (inputs, activation) until its
    gradient arrives (:meth:`take_leak`, :meth:`nopeek_loss`); a noised release is counted per client and sampling rate
    (``dp_releases``) for the accountant's epsilon."""

    client_fields = ("dp_releases",)  # per-client state that moves with a client

    def __init__(self, privacy, public_state: dict | None = None):
        self.privacy = privacy
        # the client part as the run started (packed): a language model's public base, which the token attacks
        # assume the server has (kept only for one; the reference the host already holds, not a copy)
        attack = ATTACK_PLUGINS.get(privacy.attack.kind) if privacy is not None else None
        self.public_state = public_state if attack is not None and attack.language_model else None
        self.defence = CutDefence(privacy) if privacy is not None and privacy.defence.active else None
        self._leaks: dict[Tag, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dp_releases: dict[int, dict[float, int]] = {}  # noised releases per client: {sampling rate: count}

    @property
    def accounted(self) -> bool:
        return self.defence is not None and self.defence.spec.accounted

    def release(self, tag: Tag, x: torch.Tensor, out: torch.Tensor, rate: float | None) -> tuple[torch.Tensor,
                                                                                                 int | None]:
        """What leaves instead of ``out`` (the defence's noise is drawn from the caller's random stream) and its
        bytes (None: the tensor's own). ``rate``: the release is counted at this sampling rate (None: not counted,
        e.g. when a checkpoint rebuilds a forward)."""
        sent, nbytes = self.defence.release(out)
        if self.defence.params.keeps_inputs and out.requires_grad:
            self._leaks[tag] = (x, out)
        if rate is not None and self.defence.spec.accounted:
            book = self.dp_releases.setdefault(tag.client, {})
            book[rate] = book.get(rate, 0) + 1
        return sent, nbytes

    def take_leak(self, tag: Tag) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (inputs, activation) NoPeek kept for the forward of ``tag``, no longer kept (None: none)."""
        return self._leaks.pop(tag, None)

    def nopeek_loss(self, leak: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """NoPeek's loss term on a forward's (inputs, activation)."""
        return self.defence.loss(*leak)

    def round_row(self, cid: int) -> dict:
        """What the cut adds to client ``cid``'s row of the round: its epsilon so far where releases are counted."""
        return {"dp_epsilon": self.epsilon(cid)} if self.accounted else {}

    def epsilon(self, cid: int) -> float:
        """Client ``cid``'s privacy spent so far (the accountant's epsilon at ``privacy.delta``)."""
        return self.defence.epsilon(self.dp_releases.get(cid, {}))


def reconstruction_attack(privacy, seed: int, data, states, cut: ClientCut, executor, rule, cids: list[int], rnd: int,
                          global_state: StateMsg | None = None) -> dict[int, dict]:
    """``privacy.attack`` against the clients of ``cids`` that a client host holds (its ``data``, ``states``,
    ``cut``, ``executor`` and client ``rule``), scored on the first
    ``samples`` of the client's training inputs in a seeded order, encoded by the client's current model with its
    defence applied (what the server receives for them), by the attack's plug-in given what the server would have:
    for ``reconstruction`` the auxiliary set encoded and defended the same way, for ``inversion`` ``global_state``,
    the averaged client model the server holds (where the client's own model has moved since the average, the
    attacker inverts through the wrong model, as it would). Returns per client its scores, the distance correlation
    of those inputs and what the server receives for them (``dcor``, the leakage NoPeek minimises), and the first 8
    (input, reconstruction) pairs."""
    priv, defence, data_spec = privacy, cut.defence, data.spec
    attack = ATTACK_PLUGINS[priv.attack.kind](priv)
    mine = [int(c) for c in cids if int(c) in data]
    held = lo = hi = None
    if attack.needs_held_model and mine:
        held = rule.build_module()
        held.load_state_dict(global_state.tensors())
        held.eval()
        lo, hi = to_tensor(priv.input_range, data_spec).split(1)
    if attack.language_model:
        return token_attack(priv, seed, data, states, cut, executor, rule, mine, rnd, attack)
    aux = to_tensor(priv.aux_x, data_spec) if mine and attack.needs_aux else None
    out = {}
    for c in mine:
        module, encode = _attacked(rule, states, c, rnd)

        def sent(x):  # what the server receives for inputs x
            return encode(x) if defence is None else defence.release(encode(x))[0]

        order = np.random.default_rng([seed, 0xA77, c]).permutation(data.train_idx[c])
        victim = to_tensor(data.x[np.sort(order[:priv.attack.samples])], data_spec)
        with torch.no_grad(), executor.seeded(c, 3, rnd):
            z_aux = sent(aux) if aux is not None else None
            z_vic = sent(victim)
        rec = attack.reconstruct(AttackView(
            z_vic, aux=aux, z_aux=z_aux, lo=lo, hi=hi, seed=seed * 7919 + c,
            held=rule.encoder(Tag(c, rnd, 0, "attack"), ModelSlot(held, None)) if held is not None else None))
        rec = rec.reshape(victim.shape)
        out[c] = {**reconstruction_scores(victim, rec), "dcor": float(distance_correlation(victim, z_vic)),
                  "images": (victim[:8].numpy(), rec[:8].numpy())}
        states.give_back(module)
    if held is not None:
        states.give_back(held)
    return out


def token_attack(priv, seed: int, data, states, cut: ClientCut, executor, rule, mine: list[int], rnd: int,
                 attack) -> dict[int, dict]:
    """A token-recovery attack (``attack.language_model``) against the clients ``mine``: each victim's first
    ``samples`` training blocks in a seeded order, encoded by its current client part with its defence (what the
    server receives), recovered by the plug-in from what the server would have: the public base's client part
    (``cut.public_state``: the client part as the run started) and, where it ``needs_aux``, public text (the test
    set's last blocks) encoded through that public part and the same defence. Returns per client
    ``token_recovery``, the fraction of the victim's tokens recovered."""
    from raysplit.token_privacy import token_accuracy

    if not mine:
        return {}
    defence, data_spec = cut.defence, data.spec
    public = rule.build_module()
    public.load_state_dict(transport.unpack_state(cut.public_state))
    public.eval()

    def defended(z):
        return z if defence is None else defence.release(z)[0]

    aux = to_tensor(priv.aux_x, data_spec) if attack.needs_aux else None
    out = {}
    for c in mine:
        module, encode = _attacked(rule, states, c, rnd)
        order = np.random.default_rng([seed, 0xA77, c]).permutation(data.train_idx[c])
        victim = to_tensor(data.x[np.sort(order[:priv.attack.samples])], data_spec)
        with torch.no_grad(), executor.seeded(c, 3, rnd):
            z_aux = defended(public(aux)) if aux is not None else None
            z_vic = defended(encode(victim))
        rec = attack.reconstruct(AttackView(z_vic, aux=aux, z_aux=z_aux, public=public, seed=seed * 7919 + c,
                                            vocab=data_spec.num_classes))
        out[c] = {"token_recovery": token_accuracy(rec, victim)}
        states.give_back(module)
    states.give_back(public)
    return out


def _attacked(rule, states, c: int, rnd: int):
    """Client ``c``'s part as it stands (a fresh module with its state, in eval mode) and the encoder of what it
    sends the server, for an attack on it."""
    module = rule.build_module()
    module.load_state_dict(states.state_of(c))
    module.eval()
    return module, rule.encoder(Tag(c, rnd, 0, "attack"), ModelSlot(module, None))
