"""The local backend: the same hosts in this process (identical results; the plain-loop reference in benchmarks)."""

from __future__ import annotations

from raysplit.runtime.devices import cpu_kind, determinism_state, host_device_of, machine_cores, restore_determinism
from raysplit.runtime.driver.api import RuntimeInputs, host_inputs
from raysplit.runtime.driver.ports import LocalPort
from raysplit.runtime.server import stepping
from raysplit.runtime.state import invoke


class LocalBackend:
    """Runs the hosts in this process; handles are plain values. ``runtime.torch_threads: auto`` gives the process
    the machine's cores (one process computes at a time)."""

    direct_steps = True  # split steps run stepping.run_split_steps in process, as the server actor does with Ray

    def __init__(self, num_workers: int = 1):
        self.num_workers = num_workers
        self.workers: list = []
        self.server = None
        self.threads: int | str | None = None  # the hosts' torch threads, resolved in start()
        self._kernels: dict | None = None  # this process's kernel settings before the run (the hosts may change them)

    def connect(self) -> None:
        pass

    def resolved(self) -> dict:
        devices = {"server_device": host_device_of(self.server),
                   "client_device": ",".join(sorted({host_device_of(w) for w in self.workers}))} if self.server else {}
        return {"transport": "in-process", "torch_threads": self.threads, "cpu": cpu_kind(), **devices}

    def start(self, inputs: RuntimeInputs) -> None:
        if self._kernels is None:
            self._kernels = determinism_state()
        plan = inputs.plan.with_threads(machine_cores())
        self.threads = plan.sections.runtime.torch_threads
        self.server = inputs.server_host(plan, inputs.server_init, inputs.client_init, inputs.test_data,
                                         inputs.labeled_data)
        self.workers = [inputs.client_host(plan, w, inputs.train_data, tr, te, pr, inputs.client_init)
                        for w, (tr, te, pr) in enumerate(host_inputs(inputs, self.num_workers))]

    def call(self, host, method, *args, **kwargs):
        return invoke(host, method, *args, **kwargs)

    hop = call  # a call whose result (an activation, a gradient) another host takes: nothing travels in process

    def call_n(self, host, n, method, *args, **kwargs):
        out = list(invoke(host, method, *args, **kwargs))
        if len(out) != n:
            raise RuntimeError(f"{type(host).__name__}.{method} returned {len(out)} results, expected {n}")
        return out

    def drive(self, loop: str, route: dict | None, *args):
        """Run one of ``stepping.LOOPS`` in process, as the server actor does with Ray."""
        return stepping.LOOPS[loop](self.server, *args, LocalPort(self.workers, route))

    def round_done(self) -> None:
        pass

    def put(self, value):
        return value

    def get(self, handles, timeout=None):
        return handles

    def wait(self, handles, num_ready):
        return []

    def restart(self, inputs: RuntimeInputs) -> None:
        self.start(inputs)

    def snapshot_keeper(self):
        from raysplit.runtime.driver.snapshots import LocalKeeper

        return LocalKeeper()

    def shutdown(self) -> None:
        """The hosts are dropped and the process's kernel settings are put back as they were before the run
        (``runtime.deterministic`` is set per run: a later run in this process must not inherit it)."""
        self.workers, self.server = [], None
        if self._kernels is not None:
            restore_determinism(self._kernels)
            self._kernels = None
