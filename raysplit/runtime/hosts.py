"""What runs inside the actors: a client host (many virtual clients) and a server host. No Ray here.

The rooms: ``hostspec`` (spec, model slot, shared helpers), ``screening`` (bad input), ``evaluation`` (the one
evaluation loop), ``client_host`` (assembled from its components: ``client_data``, the clients' samples and data
cursors; ``meter``, the cost meter; ``client_states``, the client-state store; ``cut``, the privacy plug-ins at the
cut; ``executor``, which runs the clients' computations; with ``client_jobs``: the event driver's jobs, and
``client_moves``: placement moves and checkpoints; ``client_transfers``: models in and out) and ``server_host``
(with ``server_steps``: the one training step and its tallies; ``server_copies``: the per-client copies of the
server model; ``screening.Screen``: what arrives); this module gathers them.

The Ray backend wraps these classes in actors; the local backend calls them in-process. Algorithms do not subclass
them: other client behaviour is a client rule (``Algorithm.client_rule``), other server behaviour a server rule
(``Algorithm.server_rule``), both in :mod:`raysplit.runtime.rules`, whose hooks the hosts call. Their own methods
are reached through ``rt.server.<method>(...)``, ``rt.client(cid).<method>(...)`` and ``rt.workers.<method>(...)``
(names checked on the driver, at the call, against the host class and the rule), their server steps through
``rt.split_steps`` / ``rt.pooled_steps`` by reference.

Client host state, per virtual client it holds: its own model weights when the algorithm keeps un-aggregated client
models (``persist_client_models``), its optimizer state (persists across rounds, as in CycleSL's code), its data
cursor (epoch and position in a permutation drawn from (seed, client, epoch)), its simulated clock and its
byte/FLOP counters. Model weights and optimizer states live in a :class:`~raysplit.runtime.spill.SpillStore`
(``runtime.placement.client_state_mb``: beyond that budget the least recently used go to disk). A client's state moves
between hosts when the runtime places it elsewhere for a round (``export_clients`` / ``import_clients``,
``runtime/placement.py``); its randomness (dropout, augmentation) is drawn per (client, round, step), so where it
runs changes nothing. A client being trained in the current round holds a module instance of its own (a
:class:`ModelSlot`), so a forward's autograd graph stays alive in the host until the gradient with the same tag
arrives; slots are released at the end of the round.

Every server-side training computation goes through :meth:`ServerHost.step_through` (``server_steps``: one forward, loss, backward,
finite check, optimizer steps, FLOPs on the clock, busy time), whatever the family: split steps, CycleSL's pooled
resampling and frozen-server gradients, SGLR's concatenated step, Hydra's heads. The one exception is
:meth:`ServerHost.train_copies` under ``algorithm.batched_copies``: the forward and backward of several per-client
copies run as one batched computation (:mod:`raysplit.runtime.batched`), and each copy's step is then completed
by the same code (:meth:`ServerHost.settle_step`).
"""

from raysplit.runtime.client_data import advance_cursor
from raysplit.runtime.client_host import ClientHost
from raysplit.runtime.evaluation import EvalTally, predict_batches
from raysplit.runtime.hostspec import (Checkpointed, ModelSlot, NonFiniteInput, NonFiniteLossError,
                                       check_finite, invoke, limit_threads, owned)
from raysplit.runtime.screening import activation_fault, gradient_fault, screens_nonfinite, where_of
from raysplit.runtime.server_host import ServerHost

__all__ = ["Checkpointed", "ClientHost", "EvalTally", "ModelSlot", "NonFiniteInput", "NonFiniteLossError",
           "ServerHost", "activation_fault", "advance_cursor", "check_finite", "gradient_fault",
           "invoke", "limit_threads", "owned", "predict_batches", "screens_nonfinite", "where_of"]
