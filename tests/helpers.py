"""Helpers the tests share (imported as ``from helpers import ...``; fixtures stay in conftest.py).

- ``make_config``: a small digits experiment with dotted-key overrides. Tests use the ``calls`` transport unless
  they test the transports themselves: idle compiled-graph client actors busy-wait, which on a 2-core machine steals
  the cores every other actor of the session needs.
- ``run_rounds`` / ``assert_identical_runs``: run an algorithm's rounds through the runtime, and compare two runs bit
  for bit (weights, clocks, losses, steps).
- ``MlflowServer``: a real ``mlflow server`` (optionally MLflow's basic-auth app) on a free port.
- ``write_fake_fashion_mnist`` / ``write_fake_cifar10``: small datasets in the real file formats; ``Touch``: a
  malicious pickle payload.
- ``counting_syncs``: counts the calls that make a host wait for a tensor's device, made within the training steps.
"""

from __future__ import annotations

import os
import socket

GET_TIMEOUT = 120  # seconds; every ray.get in tests has one


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def load_script(name: str):
    """scripts/NAME.py as a module (a fresh one each call: a test may monkeypatch it)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "scripts" /
                                                  f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

def make_config(tmp_path, mlflow_uri, **overrides):
    """A small digits experiment (fast on 2 cores) with dotted-key overrides."""
    from raysplit.config import load_config

    base = {
        "name": "test", "seed": 0,
        "algorithm.name": "sflv2",
        "data.dataset": "digits", "data.num_clients": 4, "data.partition.name": "iid", "data.test_fraction": 0.2,
        "model.name": "cnn_small", "model.cut": "conv1",
        "train.rounds": 2, "train.batch_size": 16, "train.local_steps": 4,
        "train.optimizer.lr": 0.1,
        "runtime.num_workers": 2, "runtime.server.num_cpus": 0.5, "runtime.client.num_cpus": 0.5,
        "runtime.transport.kind": "calls",
        # a test run's actors serve the session's next Ray run (a new host each; no process start nor imports)
        "runtime.keep_actors_s": 30,
        "tracking.uri": mlflow_uri, "tracking.experiment": "tests", "tracking.progress": False,
        "tracking.output_dir": str(tmp_path / "outputs"),
    }
    base.update(overrides)
    return load_config(None, base)


def run_rounds(cfg, rounds=None):
    """Run the algorithm's rounds through the runtime; return (client state, server state, prepared, stats)."""
    from raysplit.experiment import prepare
    from raysplit.runtime import runtime_for, transport

    p = prepare(cfg)
    r = cfg.runtime
    rt = runtime_for(r, p.inputs)
    try:
        stats = []
        driver = p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed)  # rounds or events
        driver.run(0, rounds or cfg.train.rounds, lambda r, st: stats.append(st))
        handle = driver.global_handle if p.algorithm.keeps_global_client_model() else None
        client = transport.unpack_state(rt.get(handle, timeout=GET_TIMEOUT).state) if handle is not None else None
        server = transport.unpack_state(rt.get(rt.server.get_state(), timeout=GET_TIMEOUT).state)
        return client, server, p, stats
    finally:
        rt.shutdown()


def crashed_run(cfg, mlflow_uri, at_round: int = 2):
    """Run ``cfg`` until its ``on_round`` for round index ``at_round`` fires, then crash it (an exception out of
    ``run_experiment``, as a killed driver would leave it); returns that MLflow run, to resume from."""
    import pytest
    from mlflow.tracking import MlflowClient

    from raysplit.experiment import run_experiment

    class Interrupted(Exception):
        pass

    def crash(rnd, metrics):
        if rnd == at_round:
            raise Interrupted()

    with pytest.raises(Interrupted):
        run_experiment(cfg, on_round=crash)
    client = MlflowClient(mlflow_uri)
    return client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id],
                              order_by=["attributes.start_time DESC"])[0]


def assert_identical_runs(x, y) -> None:
    """Two ``run_rounds`` results computed the same thing: client and server weights bit for bit, and per round
    the simulated clocks (the round's end and every client's), the server's losses and every client's steps."""
    import torch

    for a, b in ((x[0], y[0]), (x[1], y[1])):
        assert (a is None) == (b is None)
        if a is not None:
            assert set(a) == set(b)
            for k in a:
                assert torch.equal(a[k], b[k]), k
    for d, c in zip(x[3], y[3], strict=True):
        assert d.t_end == c.t_end
        assert d.server["losses"] == c.server["losses"]
        assert {k: v["t_end"] for k, v in d.clients.items()} == {k: v["t_end"] for k, v in c.clients.items()}
        assert {k: v["steps"] for k, v in d.clients.items()} == {k: v["steps"] for k, v in c.clients.items()}


class MlflowServer:
    """``mlflow server`` on a free port over one sqlite file in ``tmp`` (or ``backend_store_uri``: a PostgreSQL
    database, :class:`Postgres`); start() and stop() as often as needed.
    ``admin_password``: run MLflow's basic-auth app (``--app-name basic-auth``, needs ``mlflow[auth]``) with its
    user database in ``tmp`` and an admin user ``admin`` created with that password at first start."""

    def __init__(self, tmp, admin_password: str | None = None, backend_store_uri: str | None = None):
        self.db = backend_store_uri or f"sqlite:///{tmp / 'server.db'}"
        self.art = tmp / "artifacts"
        self.env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.args = []
        if admin_password is not None:
            ini = tmp / "basic_auth.ini"  # server side only; the admin password goes through the environment
            ini.write_text(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{tmp / 'auth.db'}\n"
                           "admin_username = admin\n"
                           "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
            self.env.update(MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_AUTH_ADMIN_PASSWORD=admin_password,
                            MLFLOW_FLASK_SERVER_SECRET_KEY=os.urandom(16).hex())
            self.args = ["--app-name", "basic-auth"]
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        import subprocess
        import sys
        import time
        import urllib.request

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.db, "--artifacts-destination",
             str(self.art), "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1", *self.args],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2)  # unprotected under basic auth too
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("mlflow server exited at start")
                time.sleep(0.5)
        raise RuntimeError("mlflow server did not come up in 120 s")

    def stop(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its workers, as a crash would
            self.proc.wait(timeout=30)
        self.proc = None


class Postgres:
    """A PostgreSQL server of its own in ``tmp`` on a free port (Debian's ``postgresql`` package, installed with apt
    when it is missing, as ``make check-ui`` installs Chromium), run as the ``postgres`` user when this process is
    root (PostgreSQL refuses to run as root); ``uri(db)`` is a SQLAlchemy URI for a database it created."""

    def __init__(self, tmp):
        from pathlib import Path

        self.data, self.sockets = Path(tmp) / "pgdata", Path(tmp) / "pgsock"
        self.port = free_port()
        self.bin = None

    def _run(self, *argv, check=True):
        import subprocess

        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=120, check=check)

    def start(self) -> None:
        import glob
        import shutil
        import subprocess

        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                           "--no-install-recommends postgresql", shell=True, check=True, timeout=900,
                           capture_output=True)
            found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        self.bin = os.path.dirname(found[-1])
        for d in (self.data, self.sockets):
            d.mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0:
                shutil.chown(d, "postgres", "postgres")
        if os.geteuid() == 0:  # the postgres user must reach the directories under pytest's temporary root
            p = self.data.parent
            while str(p) not in ("/", "/tmp"):
                os.chmod(p, os.stat(p).st_mode | 0o011)
                p = p.parent
        self._run(f"{self.bin}/initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres")
        self._run(f"{self.bin}/pg_ctl", "-D", str(self.data), "-w", "-l", str(self.data / "server.log"), "-o",
                  f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c max_connections=200", "start")

    def create(self, db: str) -> str:
        self._run(f"{self.bin}/createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", db)
        return self.uri(db)

    def uri(self, db: str) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{db}"  # SQLAlchemy 2.1 defaults to psycopg 3

    def stop(self) -> None:
        if self.bin is not None:
            self._run(f"{self.bin}/pg_ctl", "-D", str(self.data), "-m", "immediate", "stop", check=False)


def write_fake_fashion_mnist(root, n_train: int = 600, n_test: int = 100, seed: int = 0) -> None:
    """Small fake Fashion-MNIST in the real IDX format under ``root/fashion_mnist`` (uint8 28x28 images, balanced
    labels, a band per class: learnable, still images)."""
    import gzip
    import struct
    from pathlib import Path

    import numpy as np

    folder = Path(root) / "fashion_mnist"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        y = np.tile(np.arange(10, dtype=np.uint8), n // 10)
        x = rng.integers(0, 120, (n, 28, 28), dtype=np.uint8)
        for c in range(10):
            x[y == c, 2 * c:2 * c + 6, 4:24] += 120
        for kind, arr in (("images-idx3", x), ("labels-idx1", y)):
            header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + b"".join(struct.pack(">I", d) for d in arr.shape)
            with gzip.open(folder / f"{prefix}-{kind}-ubyte.gz", "wb") as f:
                f.write(header + arr.tobytes())


def write_fake_cifar10(root, per_batch: int, test: int = 40, seed: int = 0) -> None:
    """CIFAR-10's python pickles in the real layout under ``root/cifar10`` (random images, balanced labels)."""
    import pickle

    import numpy as np

    rng = np.random.default_rng(seed)
    d = root / "cifar10" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    for fname, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", test)]:
        with open(d / fname, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         b"labels": np.tile(np.arange(10), n // 10).tolist()}, f)


def write_fake_cifar100(root, train: int, test: int, seed: int = 0) -> None:
    """CIFAR-100's python pickles in the real layout under ``root/cifar-100-python`` (random images and labels)."""
    import pickle

    import numpy as np

    rng = np.random.default_rng(seed)
    d = root / "cifar-100-python"
    d.mkdir(parents=True)
    for fname, n in (("train", train), ("test", test)):
        with open(d / fname, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         b"fine_labels": rng.integers(0, 100, n).tolist(),
                         b"coarse_labels": rng.integers(0, 20, n).tolist()}, f)


def write_fake_svhn(root, train: int, test: int, seed: int = 0) -> None:
    """SVHN's ``train_32x32.mat`` / ``test_32x32.mat`` (X as HWCN, label 10 for digit 0) under ``root/svhn``."""
    import numpy as np
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    d = root / "svhn"
    d.mkdir(parents=True)
    for split, n in (("train", train), ("test", test)):
        savemat(d / f"{split}_32x32.mat", {"X": rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8),
                                           "y": (np.arange(n) % 10 + 1).astype(np.uint8).reshape(n, 1)})


def write_fake_leaf(root, name: str, users: int, per_user: int, seed: int = 0) -> None:
    """LEAF's JSON files (``train/``, ``test/``) of ``femnist`` (784 floats k/255, 62 classes) or ``shakespeare``
    (80-character strings and the next character) under ``root/name/data``, ``users`` writers or roles."""
    import json

    import numpy as np

    from raysplit.data import LEAF_ALL_LETTERS

    rng = np.random.default_rng(seed)

    def samples(n):
        if name == "femnist":
            return {"x": (rng.integers(0, 256, (n, 784)) / 255.0).tolist(), "y": rng.integers(0, 62, n).tolist()}
        letters = list(LEAF_ALL_LETTERS)
        return {"x": ["".join(rng.choice(letters, 80)) for _ in range(n)],
                "y": [str(rng.choice(letters)) for _ in range(n)]}

    for split, n in (("train", per_user), ("test", max(1, per_user // 4))):
        d = root / name / "data" / split
        d.mkdir(parents=True)
        data = {f"u{i:04d}": samples(n) for i in range(users)}
        blob = {"users": list(data), "num_samples": [n] * users, "user_data": data}
        (d / f"all_data_0_niid_{split}.json").write_text(json.dumps(blob))


class Touch:
    """Unpickling this runs ``marker.touch()``: what a malicious pickle (a "CIFAR batch", a "checkpoint") from the
    internet would do. Tests check it is refused and ``marker`` never appears."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (self.marker,))


def import_graph(root, package: str = "raysplit") -> tuple[dict[str, set], dict[str, set]]:
    """The import graph of ``package`` under ``root``, read from the source (no import): ``(needs, external)``.
    ``needs[m]``: the package's modules that must be fully imported while ``m`` is imported: every import at module
    level, in class bodies and in if/try blocks (not in function bodies), a ``from pkg import name`` of a name that
    is no module counting as ``pkg``; packages above ``m`` are left out (they are in sys.modules, partly imported,
    before ``m`` runs) unless ``m`` takes a name from them. ``external[m]``: the top-level names of the other
    packages ``m`` imports."""
    import ast
    from pathlib import Path

    root = Path(root)
    raw: dict[str, list] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        parts = parts[:-1] if is_pkg else parts
        here = parts if is_pkg else parts[:-1]
        found: list = []

        def visit(body):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    continue
                if isinstance(node, ast.Import):
                    found.extend(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = here[:len(here) - node.level + 1] if node.level else []
                    mod = ".".join(base + ([node.module] if node.module else []))
                    found.extend((mod, a.name) for a in node.names)
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):
                        visit(sub)

        visit(ast.parse(path.read_text()).body)
        raw[".".join(parts)] = found
    mods = set(raw)

    def chain(name: str) -> set:
        p = name.split(".")
        return {".".join(p[:i]) for i in range(1, len(p) + 1)} & mods

    needs: dict[str, set] = {}
    external: dict[str, set] = {}
    for m, found in raw.items():
        needs[m], external[m] = set(), set()
        for x in found:
            if isinstance(x, tuple):
                exact = f"{x[0]}.{x[1]}" if f"{x[0]}.{x[1]}" in mods else x[0]
            else:
                exact = x
            if exact.split(".")[0] != package:
                external[m].add(exact.split(".")[0])
                continue
            needs[m] |= {p for p in chain(exact) if p == exact or not m.startswith(p + ".")}
        needs[m].discard(m)
    return needs, external


def import_cycles(needs: dict[str, set]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``needs`` meets (each as ``[a, b, ..., a]``); empty when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def walk(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(needs.get(u, ())):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                walk(v)
        stack.pop()
        state[u] = 2

    for m in sorted(needs):
        if m not in state:
            walk(m)
    return cycles


def imported_closure(needs: dict[str, set], start: str) -> set:
    """Every module of the package under ``start`` and every module importing one of them imports (packages above a
    module included: they run first)."""
    seen, todo = set(), [m for m in needs if m == start or m.startswith(start + ".")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(needs.get(m, ()))
            parts = m.split(".")
            todo.extend(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in needs)
    return seen


def capture_runtimes(monkeypatch) -> list:
    """Make ``run_experiment`` record every Runtime it builds (for a test to reach the hosts); returns the list."""
    import raysplit.experiment as experiment

    made: list = []
    build = experiment.runtime_for

    def capture(*a, **kw):
        made.append(build(*a, **kw))
        return made[-1]

    monkeypatch.setattr(experiment, "runtime_for", capture)
    return made


def runtime_private_names(runtime_dir) -> set[str]:
    """Every private (single-underscore) method or attribute name the runtime defines (``def _x`` or ``obj._x =``)."""
    import ast

    names = set()
    from pathlib import Path

    for path in Path(runtime_dir).rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = n.name
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                name = n.attr
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


MESSAGES = {"Activation", "Gradient", "StateMsg"}


def contract_violations(source: str, private: set[str]) -> list[str]:
    """Where an algorithm module steps outside the public runtime contract: it names the wire format (the
    ``transport`` module), builds a message from a raw payload (``Activation(...)``, ``Gradient(...)``,
    ``StateMsg(...)``: the runtime makes them; ``StateMsg.packed(tensors)`` and ``answer`` are the ways in), reads or
    writes a host's clock field (``self.clock``, ``self.meter.clock``: the cost meter's ``now``, ``wait_until``, ``charge_*`` and
    ``answer`` stamp time), or uses or overrides a private runtime name."""
    import ast

    out = []
    for n in ast.walk(ast.parse(source)):
        imported = ([n.module or "", *(a.name for a in n.names)] if isinstance(n, ast.ImportFrom) else
                    [a.name for a in n.names] if isinstance(n, ast.Import) else [])
        if any(name.split(".")[-1] == "transport" for name in imported):
            out.append(f"line {n.lineno}: imports the transport module")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in MESSAGES:
            out.append(f"line {n.lineno}: builds a {n.func.id} from a raw payload")
        elif isinstance(n, ast.Name) and n.id == "transport":
            out.append(f"line {n.lineno}: names transport")
        elif isinstance(n, ast.Attribute) and n.attr == "clock" and (
                isinstance(n.value, ast.Name) and n.value.id == "self" or
                isinstance(n.value, ast.Attribute) and n.value.attr == "meter"):
            out.append(f"line {n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.Attribute) and n.attr in private:
            out.append(f"line {n.lineno}: private runtime name .{n.attr}")
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in private:
            out.append(f"line {n.lineno}: overrides private runtime name {n.name}")
    return out


# ---- host synchronisation in the step path (issue 70) ----------------------------------------------------------------
# the calls on a tensor that wait for its device where it is an accelerator: a read of its values into host memory
SYNCING = ("item", "cpu", "numpy", "tolist", "__float__", "__int__", "__bool__", "__array__")
# where a tensor's reads are of tensors made in host memory by design, never on a device: the augmentation draws its
# random crops and cutouts with torch's CPU generator on uint8 images cut from the host's copy of the dataset
HOST_MEMORY_FILES = ("raysplit/data/augment.py",)


class SyncCount:
    """What :func:`counting_syncs` saw: ``steps`` (client steps taken: the cost meters' ``steps``) and ``syncs``
    (per ``"call file:line in function"``: the innermost raysplit frame that made it)."""

    def __init__(self):
        import collections

        self.steps = 0
        self.syncs = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.syncs.values())

    def per_step(self) -> float:
        return self.total / max(self.steps, 1)

    def where(self, n: int = 8) -> str:
        return "; ".join(f"{c} x {k}" for k, c in self.syncs.most_common(n))


def counting_syncs():
    """A context manager counting the synchronising tensor calls (:data:`SYNCING`) made inside a training step:
    within the server's step loops (``stepping.LOOPS``: the split and pooled steps, every call they make to the
    hosts), an event loop's arrival (the server's step on it, a flush, the answer) and a client's local step.
    What a round does around them (its end: deferred checks, tallies; aggregation, evaluation) is not a step, nor
    is a job's start and end (a client's model arriving and leaving, once a job, within an arrival in process).
    Calls made from :data:`HOST_MEMORY_FILES` are not counted."""
    import contextlib
    import functools
    import traceback

    import torch

    from raysplit.runtime.client import jobs, meter
    from raysplit.runtime.server import events, stepping

    @contextlib.contextmanager
    def run():
        got, depth = SyncCount(), [0]
        saved = {n: getattr(torch.Tensor, n) for n in SYNCING}
        loops = dict(stepping.LOOPS)
        scoped = {(events.EventLoop, "_arrival"), (jobs.LocalJobs, "_local_step")}
        unscoped = {(jobs.LocalJobs, "join"), (jobs.LocalJobs, "leave")}
        saved_methods = {(cls, name): getattr(cls, name) for cls, name in scoped | unscoped}
        count = meter.CostMeter.count

        def counted(name):
            real = saved[name]

            @functools.wraps(real)
            def call(self, *a, **kw):
                if depth[0]:
                    frames = [f for f in traceback.extract_stack()[:-1] if "/raysplit/" in f.filename
                              and "/site-packages/" not in f.filename]  # a checkout named raysplit holds its venv
                    if frames:
                        f = frames[-1]
                        path = "raysplit/" + f.filename.rsplit("/raysplit/", 1)[-1]  # the package's, in any checkout
                        if path not in HOST_MEMORY_FILES:
                            got.syncs[f"{name} {path}:{f.lineno} in {f.name}"] += 1
                return real(self, *a, **kw)
            return call

        def step_scope(fn):
            @functools.wraps(fn)
            def inner(*a, **kw):
                depth[0] += 1
                try:
                    return fn(*a, **kw)
                finally:
                    depth[0] -= 1
            return inner

        def job_scope(fn):
            @functools.wraps(fn)
            def inner(*a, **kw):
                outer, depth[0] = depth[0], 0
                try:
                    return fn(*a, **kw)
                finally:
                    depth[0] = outer
            return inner

        def count_steps(self, cid, **kw):
            got.steps += int(kw.get("steps", 0))
            return count(self, cid, **kw)

        for n in SYNCING:
            setattr(torch.Tensor, n, counted(n))
        for k in ("steps", "pooled"):
            stepping.LOOPS[k] = step_scope(loops[k])
        for (cls, name), fn in saved_methods.items():
            setattr(cls, name, (step_scope if (cls, name) in scoped else job_scope)(fn))
        meter.CostMeter.count = count_steps
        try:
            yield got
        finally:
            for n, fn in saved.items():
                setattr(torch.Tensor, n, fn)
            stepping.LOOPS.update(loops)
            for (cls, name), fn in saved_methods.items():
                setattr(cls, name, fn)
            meter.CostMeter.count = count

    return run()
