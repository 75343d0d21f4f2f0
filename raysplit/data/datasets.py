"""Dataset loaders for raysplit.

Every loader reads files that are already on disk; nothing here downloads.  A
missing dataset raises :class:`DatasetNotFoundError`, whose message lists every
path that was looked at and how to obtain the files on a connected machine.

Conventions
-----------
* ``kind == "image"``: ``x`` is ``uint8`` of shape ``(N, C, H, W)``; ``spec.mean`` /
  ``spec.std`` are per-channel statistics on the ``[0, 1]`` scale and are applied by
  :func:`to_tensor` (``x / 255`` then ``(x - mean) / std``).
* ``kind == "float"``: ``x`` is ``float32`` and already normalised; :func:`to_tensor`
  passes it through.
* ``kind == "tokens"``: ``x`` is ``int64`` of shape ``(N, seq_len)``.
* ``y`` is always ``int64`` of shape ``(N,)``.

Normalisation statistics follow the seed code (see ``shared/notes/seed-code.md``):
CIFAR-10 uses mean (0.4914, 0.4822, 0.4465) and std (0.2023, 0.1994, 0.2010), SVHN
0.5/0.5, and FEMNIST (stored as ``uint8`` images, LEAF's white-background
convention kept) uses (0.9637,)/(0.1597,).
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import json
import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

__all__ = [
    "DataSpec",
    "DatasetBundle",
    "DatasetNotFoundError",
    "DATASETS",
    "LEAF_ALL_LETTERS",
    "default_data_root",
    "files_digest",
    "load_dataset",
    "to_tensor",
]

#: Where the Debian package ``dataset-fashion-mnist`` installs its files.
DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

#: LEAF's Shakespeare vocabulary (``leaf/models/utils/language_utils.py``), 80 characters.
LEAF_ALL_LETTERS = (
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
)
assert len(LEAF_ALL_LETTERS) == 80


# --------------------------------------------------------------------------- types


@dataclass(frozen=True)
class DataSpec:
    """Small, picklable description of a dataset (shipped to actors instead of data)."""

    name: str
    kind: str  # "image" | "float" | "tokens"
    input_shape: tuple
    num_classes: int
    mean: tuple | None = None
    std: tuple | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("image", "float", "tokens"):
            raise ValueError(f"DataSpec.kind must be 'image', 'float' or 'tokens', got {self.kind!r}")
        object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        if self.mean is not None:
            object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        if self.std is not None:
            object.__setattr__(self, "std", tuple(float(s) for s in self.std))


@dataclass
class DatasetBundle:
    """Arrays of one dataset plus its :class:`DataSpec`.

    ``natural_train[i]`` / ``natural_test[i]`` (LEAF only) index ``x_train`` / ``x_test``
    for the same writer/user ``natural_users[i]``; a user may have an empty test array.
    """

    spec: DataSpec
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    natural_train: list[np.ndarray] | None = None
    natural_test: list[np.ndarray] | None = None
    natural_users: list[str] | None = field(default=None)
    files: tuple[str, ...] = ()  # the files it was read from (resolved paths), for provenance (files_digest)

    def __repr__(self) -> str:  # arrays are large; keep the repr short
        nat = "" if self.natural_train is None else f", users={len(self.natural_train)}"
        return (
            f"DatasetBundle({self.spec.name!r}, kind={self.spec.kind!r}, "
            f"train={tuple(self.x_train.shape)}, test={tuple(self.x_test.shape)}, "
            f"classes={self.spec.num_classes}{nat})"
        )


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not on disk.  ``str(err)`` names the dataset, every path
    looked at, and how to obtain the files."""

    def __init__(self, name: str, looked_at: list[str] | tuple[str, ...], how_to: str):
        self.name = name
        self.looked_at = [str(p) for p in looked_at]
        self.how_to = how_to
        lines = [f"dataset {name!r} not found (no downloads are attempted). Looked at:"]
        lines += [f"  - {p}" for p in self.looked_at]
        lines += ["How to obtain it:", how_to.rstrip()]
        super().__init__("\n".join(lines))

    def __reduce__(self):  # keep it picklable (e.g. when raised inside a worker)
        return (type(self), (self.name, self.looked_at, self.how_to))


# --------------------------------------------------------------------------- helpers


def default_data_root() -> str:
    """``$RAYSPLIT_DATA`` if set (and non-empty), else ``~/.cache/raysplit/data``."""
    env = os.environ.get("RAYSPLIT_DATA")
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), ".cache", "raysplit", "data")


def files_digest(files: list[str] | tuple[str, ...]) -> str:
    """SHA-256 over the files' names and contents (16 hex digits): what a run's dataset record names, so that two
    runs on different copies of a dataset can be told apart."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(os.path.basename(f).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def _root(root: str | os.PathLike | None) -> Path:
    return Path(default_data_root() if root is None else os.path.expanduser(str(root)))


def to_tensor(x: np.ndarray | torch.Tensor, spec: DataSpec) -> torch.Tensor:
    """Convert stored arrays to model inputs (a tensor of stored values, e.g. already on a GPU, is converted where
    it is).

    image: float32 ``x / 255`` then ``(x - mean) / std`` per channel (channel axis is the
    first axis of ``spec.input_shape``; works for a batch ``(N, C, H, W)`` or a single
    sample ``(C, H, W)``); float: float32 as is; tokens: ``torch.long``.
    """
    if isinstance(x, torch.Tensor):
        t = x
        if spec.kind == "tokens":
            return t.to(torch.long)
    else:
        a = np.asarray(x)
        if not a.flags.writeable:  # read-only views straight from Ray's object store
            a = a.copy()
        if spec.kind == "tokens":
            return torch.as_tensor(a, dtype=torch.long)
        t = torch.from_numpy(a)
    if spec.kind == "float":
        return t.to(torch.float32)
    # image
    t = t.to(torch.float32).div_(255.0)
    if spec.mean is not None or spec.std is not None:
        c = spec.input_shape[0]
        bshape = (c,) + (1,) * (len(spec.input_shape) - 1)
        mean = torch.tensor(spec.mean if spec.mean is not None else (0.0,) * c, dtype=torch.float32, device=t.device)
        std = torch.tensor(spec.std if spec.std is not None else (1.0,) * c, dtype=torch.float32, device=t.device)
        t = (t - mean.view(bshape)) / std.view(bshape)
    return t


def _as_labels(y) -> np.ndarray:
    return np.asarray(y).reshape(-1).astype(np.int64)


def _first_dir_with(candidates: list[Path], filesets: list[list[str]]) -> tuple[Path, list[Path]] | None:
    """Return (dir, files) for the first candidate dir holding one file of every
    alternatives-list in ``filesets``."""
    for d in candidates:
        found = []
        for alternatives in filesets:
            hit = next((d / f for f in alternatives if (d / f).is_file()), None)
            if hit is None:
                break
            found.append(hit)
        else:
            return d, found
    return None


def _dedupe(paths: list[Path]) -> list[Path]:
    out, seen = [], set()
    for p in paths:
        key = str(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


# --------------------------------------------------------------------------- IDX (MNIST-style)

_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (``.gz`` or raw, detected by the gzip magic bytes)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:  # a truncated or corrupt .gz
        raise ValueError(f"{path}: unreadable IDX file ({type(e).__name__}: {e})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (magic {data[:4]!r})")
    dtype = _IDX_DTYPES[data[2]]
    ndim = data[3]
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    count = int(np.prod(dims)) if dims else 1
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(f"{path}: IDX header says {dims} but payload has {len(data) - offset} bytes")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


_FMNIST_FILES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]


def load_fashion_mnist(root: str | None = None, *, search_system: bool = True) -> DatasetBundle:
    """Fashion-MNIST from IDX files (gz or raw).

    Looked for, in order: ``root``, ``root/fashion_mnist``, ``root/fashion-mnist``,
    ``root/FashionMNIST/raw`` (torchvision layout) and, if ``search_system``,
    ``/usr/share/datasets/fashion-mnist`` (Debian package ``dataset-fashion-mnist``) — the system copy only when
    no ``root`` was given: an explicitly given location that lacks the files is an error naming it, never silently
    replaced by another source.
    """
    r = _root(root)
    candidates = [r, r / "fashion_mnist", r / "fashion-mnist", r / "FashionMNIST" / "raw"]
    if search_system and root is None:
        candidates.append(Path(DEBIAN_FASHION_MNIST_DIR))
    candidates = _dedupe(candidates)
    hit = _first_dir_with(candidates, [[f + ".gz", f] for f in _FMNIST_FILES])
    if hit is None:
        raise DatasetNotFoundError(
            "fashion_mnist",
            [f"{d}/{{{','.join(_FMNIST_FILES)}}}[.gz]" for d in candidates],
            "  * Debian/Ubuntu: `apt-get install dataset-fashion-mnist` "
            f"(installs the four IDX .gz files into {DEBIAN_FASHION_MNIST_DIR}), or\n"
            "  * on a connected machine: `python -c \"import torchvision; "
            f"torchvision.datasets.FashionMNIST('{r}', train=True, download=True); "
            f"torchvision.datasets.FashionMNIST('{r}', train=False, download=True)\"` "
            f"and copy {r}/FashionMNIST/raw over, or\n"
            "  * copy the four files from https://github.com/zalandoresearch/fashion-mnist "
            f"(data/fashion) into {r / 'fashion_mnist'}."
            + (f"\n  * or leave data.root unset: then {DEBIAN_FASHION_MNIST_DIR} is searched too (data.root="
               f"{root!r} was given, so it is not used in its place)." if root is not None and search_system
               else ""),
        )
    _, (xtr, ytr, xte, yte) = hit
    x_train, y_train = read_idx(xtr), read_idx(ytr)
    x_test, y_test = read_idx(xte), read_idx(yte)
    for x, y, p in ((x_train, y_train, xtr), (x_test, y_test, xte)):
        if x.ndim != 3 or x.shape[0] != y.shape[0]:
            raise ValueError(f"{p}: images {x.shape} do not match labels {y.shape}")
    for y, p in ((y_train, ytr), (y_test, yte)):
        if y.size and (int(y.min()) < 0 or int(y.max()) > 9):
            raise ValueError(f"{p}: Fashion-MNIST labels must lie in 0..9, found {y.min()}..{y.max()}")
    spec = DataSpec("fashion_mnist", "image", (1, 28, 28), 10, (0.2860,), (0.3530,))
    return DatasetBundle(
        spec,
        np.ascontiguousarray(x_train[:, None].astype(np.uint8)),
        _as_labels(y_train),
        np.ascontiguousarray(x_test[:, None].astype(np.uint8)),
        _as_labels(y_test),
        files=tuple(str(Path(f).resolve()) for f in (xtr, ytr, xte, yte)),
    )


# --------------------------------------------------------------------------- digits (bundled)


def load_digits(root: str | None = None, *, test_fraction: float = 0.2, seed: int = 0) -> DatasetBundle:
    """scikit-learn's bundled 8x8 digits (1797 samples, no files needed).

    ``kind="float"``: pixels / 16, then standardised with the scalar mean/std of the
    training split; deterministic stratified split (``seed``, ``test_fraction``).
    ``root`` is ignored.
    """
    from sklearn.datasets import load_digits as _sk_load_digits
    from sklearn.model_selection import train_test_split

    d = _sk_load_digits()
    x = (d.data.astype(np.float64) / 16.0).reshape(-1, 1, 8, 8)
    y = d.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, stratify=y, random_state=seed
    )
    mean, std = float(x_tr.mean()), float(x_tr.std())
    x_tr = ((x_tr - mean) / std).astype(np.float32)
    x_te = ((x_te - mean) / std).astype(np.float32)
    spec = DataSpec("digits", "float", (1, 8, 8), 10)
    from importlib.resources import files

    source = files("sklearn.datasets.data") / "digits.csv.gz"
    return DatasetBundle(spec, x_tr, y_tr, x_te, y_te, files=(str(source),) if source.is_file() else ())


# --------------------------------------------------------------------------- CIFAR

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)  # the value used by the seed code (GAS, Semi-SFL, CycleSL)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


class _ArraysOnly(pickle.Unpickler):
    """An unpickler for CIFAR's batches that builds dicts, lists, strings, numbers and numpy arrays and nothing
    else: a pickle from the internet that names any other callable (``os.system``, ...) is refused, not run."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refused to load {module}.{name} (CIFAR batches hold only arrays and "
                                         "lists; this file is not a CIFAR batch, or it was tampered with)")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            d = _ArraysOnly(f, encoding="bytes").load()
    except Exception as e:  # noqa: BLE001 - truncated, tampered or not a pickle: one error naming the file
        raise ValueError(f"{path}: not a readable CIFAR batch ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a CIFAR batch (a {type(d).__name__}, not a dict)")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}


def _field(batch: dict, key: str, path: Path):
    if key not in batch:
        raise ValueError(f"{path}: CIFAR batch has no {key!r} (keys: {sorted(batch)})")
    return batch[key]


def _cifar_images(data, path: Path) -> np.ndarray:
    x = np.asarray(data, dtype=np.uint8)
    if x.ndim != 2 or x.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: CIFAR data must be (N, 3072) uint8 rows, got shape {x.shape}")
    return np.ascontiguousarray(x.reshape(-1, 3, 32, 32))


def _checked_labels(y, n: int, classes: int, path: Path) -> np.ndarray:
    y = _as_labels(y)
    if len(y) != n:
        raise ValueError(f"{path}: {len(y)} labels for {n} images")
    if len(y) and (y.min() < 0 or y.max() >= classes):
        raise ValueError(f"{path}: labels must lie in 0..{classes - 1}, found {y.min()}..{y.max()}")
    return y


def _cifar_howto(what: str, archive: str, r: Path, tv_class: str) -> str:
    return (
        f"  * on a connected machine: `python -c \"import torchvision; "
        f"torchvision.datasets.{tv_class}('{r}', download=True)\"` and copy {r}/{archive} "
        f"over, or\n  * download and extract {what} (python version) from "
        "https://www.cs.toronto.edu/~kriz/cifar.html into the data root."
    )


def load_cifar10(root: str | None = None) -> DatasetBundle:
    """CIFAR-10 from the python pickles (``cifar-10-batches-py/data_batch_1..5``,
    ``test_batch``) under ``root``, ``root/cifar10`` or ``root/cifar-10``."""
    r = _root(root)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    candidates = _dedupe(
        [b / "cifar-10-batches-py" for b in (r, r / "cifar10", r / "cifar-10")] + [r / "cifar10"]
    )
    hit = _first_dir_with(candidates, [[n] for n in names])
    if hit is None:
        raise DatasetNotFoundError(
            "cifar10",
            [f"{d}/{{data_batch_1..5,test_batch}}" for d in candidates],
            _cifar_howto("cifar-10-python.tar.gz", "cifar-10-batches-py", r, "CIFAR10"),
        )
    _, files = hit
    xs, ys = [], []
    for p in files:
        b = _unpickle(p)
        xs.append(_cifar_images(_field(b, "data", p), p))
        ys.append(_checked_labels(_field(b, "labels", p), len(xs[-1]), 10, p))
    x_train, y_train = np.concatenate(xs[:5]), np.concatenate(ys[:5])
    x_test, y_test = xs[5], ys[5]
    spec = DataSpec("cifar10", "image", (3, 32, 32), 10, CIFAR10_MEAN, CIFAR10_STD)
    return DatasetBundle(spec, x_train, y_train, x_test, y_test, files=tuple(str(Path(f).resolve()) for f in files))


def load_cifar100(root: str | None = None, *, label: str = "fine") -> DatasetBundle:
    """CIFAR-100 from the python pickles (``cifar-100-python/train``, ``test``) under
    ``root``, ``root/cifar100`` or ``root/cifar-100``; ``label="fine"`` (100 classes)
    or ``"coarse"`` (20 superclasses)."""
    if label not in ("fine", "coarse"):
        raise ValueError(f"cifar100: label must be 'fine' or 'coarse', got {label!r}")
    r = _root(root)
    candidates = _dedupe(
        [b / "cifar-100-python" for b in (r, r / "cifar100", r / "cifar-100")] + [r / "cifar100"]
    )
    hit = _first_dir_with(candidates, [["train"], ["test"]])
    if hit is None:
        raise DatasetNotFoundError(
            "cifar100",
            [f"{d}/{{train,test}}" for d in candidates],
            _cifar_howto("cifar-100-python.tar.gz", "cifar-100-python", r, "CIFAR100"),
        )
    _, (ptr, pte) = hit
    tr, te = _unpickle(ptr), _unpickle(pte)
    key = f"{label}_labels"
    spec = DataSpec(
        "cifar100", "image", (3, 32, 32), 100 if label == "fine" else 20, CIFAR100_MEAN, CIFAR100_STD
    )
    xtr, xte = _cifar_images(_field(tr, "data", ptr), ptr), _cifar_images(_field(te, "data", pte), pte)
    ytr = _checked_labels(_field(tr, key, ptr), len(xtr), spec.num_classes, ptr)
    yte = _checked_labels(_field(te, key, pte), len(xte), spec.num_classes, pte)
    return DatasetBundle(spec, xtr, ytr, xte, yte, files=(str(Path(ptr).resolve()), str(Path(pte).resolve())))


# --------------------------------------------------------------------------- SVHN


def load_svhn(root: str | None = None, *, include_extra: bool = False) -> DatasetBundle:
    """SVHN cropped digits from ``train_32x32.mat`` / ``test_32x32.mat`` (and
    ``extra_32x32.mat`` if ``include_extra``) under ``root``, ``root/svhn`` or
    ``root/SVHN``.  ``X`` is HWCN in the files; label 10 means digit 0."""
    from scipy.io import loadmat

    r = _root(root)
    candidates = _dedupe([r, r / "svhn", r / "SVHN"])
    needed = [["train_32x32.mat"], ["test_32x32.mat"]] + ([["extra_32x32.mat"]] if include_extra else [])
    hit = _first_dir_with(candidates, needed)
    if hit is None:
        files = ",".join(n[0] for n in needed)
        raise DatasetNotFoundError(
            "svhn",
            [f"{d}/{{{files}}}" for d in candidates],
            "  * on a connected machine: `python -c \"import torchvision; "
            f"torchvision.datasets.SVHN('{r / 'svhn'}', split='train', download=True); "
            f"torchvision.datasets.SVHN('{r / 'svhn'}', split='test', download=True)\"` and copy "
            f"the .mat files over, or\n  * download {files} from http://ufldl.stanford.edu/housenumbers/ "
            f"into {r / 'svhn'}.",
        )

    def read(p: Path) -> tuple[np.ndarray, np.ndarray]:
        m = loadmat(p)
        x = np.ascontiguousarray(np.transpose(np.asarray(m["X"], dtype=np.uint8), (3, 2, 0, 1)))
        y = _as_labels(m["y"])
        y[y == 10] = 0
        return x, y

    _, files = hit
    x_train, y_train = read(files[0])
    x_test, y_test = read(files[1])
    if include_extra:
        x_ex, y_ex = read(files[2])
        x_train, y_train = np.concatenate([x_train, x_ex]), np.concatenate([y_train, y_ex])
    spec = DataSpec("svhn", "image", (3, 32, 32), 10, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    return DatasetBundle(spec, x_train, y_train, x_test, y_test,
                         files=tuple(str(Path(f).resolve()) for f in files[:3 if include_extra else 2]))


# --------------------------------------------------------------------------- LEAF


def _leaf_candidates(r: Path, name: str) -> list[Path]:
    return _dedupe(
        [
            r / name / "data",
            r / name,
            r / "leaf" / "data" / name / "data",
            r / "leaf" / name / "data",
            r,
        ]
    )


def _leaf_read_split(d: Path) -> list[tuple[str, list, list, Path]]:
    """All (user, xs, ys, file) from ``d/*.json`` in sorted file order and each file's user order. A file that is
    not LEAF's JSON (unreadable, truncated, no ``user_data``, a user without equally long ``x`` and ``y`` lists) is
    a ValueError naming the file and what is wrong."""
    out: list[tuple[str, list, list, Path]] = []
    for p in sorted(d.glob("*.json")):
        try:
            with open(p, "rb") as f:
                blob = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{p}: not a readable LEAF JSON file (truncated or corrupt?): {e}") from None
        if not isinstance(blob, dict) or not isinstance(blob.get("user_data"), dict):
            raise ValueError(f"{p}: a LEAF file is an object with a 'user_data' object, got "
                             f"{sorted(blob) if isinstance(blob, dict) else type(blob).__name__}")
        users = blob.get("users") or list(blob["user_data"].keys())
        for u in users:
            ud = blob["user_data"].get(u)
            if not isinstance(ud, dict) or not isinstance(ud.get("x"), list) or not isinstance(ud.get("y"), list):
                raise ValueError(f"{p}: LEAF user {u!r} has no 'x' and 'y' lists in 'user_data'")
            if len(ud["x"]) != len(ud["y"]):
                raise ValueError(f"{p}: LEAF user {u!r}: {len(ud['x'])} x but {len(ud['y'])} y")
            out.append((str(u), ud["x"], ud["y"], p))
    return out


def _leaf_load(root, name: str, how_to: str):
    r = _root(root)
    candidates = _leaf_candidates(r, name)
    looked = []
    for d in candidates:
        looked.append(f"{d}/train/*.json + {d}/test/*.json")
        if any((d / "train").glob("*.json")) and any((d / "test").glob("*.json")):
            return _leaf_read_split(d / "train"), _leaf_read_split(d / "test")
    raise DatasetNotFoundError(name, looked, how_to)


def _leaf_assemble(train, test, convert_x, convert_y):
    """Concatenate per-user samples; return arrays and aligned per-user index lists.

    Users are ordered by first appearance in the train files, then users that only
    appear in the test files.  A user repeated across files is merged. A sample that
    ``convert_x`` / ``convert_y`` refuses (ValueError) names its file, user and index.
    """
    order: list[str] = []
    pos: dict[str, int] = {}
    for u, _, _, _ in list(train) + list(test):
        if u not in pos:
            pos[u] = len(order)
            order.append(u)

    def build(records):
        xs, ys, owner = [], [], []
        for u, x, y, path in records:
            for i, (a, b) in enumerate(zip(x, y)):
                try:
                    xs.append(convert_x(a))
                    ys.append(convert_y(b))
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{path}: LEAF user {u!r}, sample {i}: {e}") from None
            owner.extend([pos[u]] * len(x))
        owner = np.asarray(owner, dtype=np.int64)
        return xs, np.asarray(ys, dtype=np.int64), _group(owner, len(order))

    return order, build(train), build(test)


def _group(owner: np.ndarray, n: int) -> list[np.ndarray]:
    sort = np.argsort(owner, kind="stable").astype(np.int64)
    bounds = np.searchsorted(owner[sort], np.arange(n + 1))
    return [sort[bounds[k] : bounds[k + 1]] for k in range(n)]


_LEAF_HOWTO = (
    "  * on a connected machine clone https://github.com/TalwalkarLab/leaf and run its "
    "preprocessing, e.g. `cd leaf/data/{name} && ./preprocess.sh {args}`, then copy "
    "leaf/data/{name}/data/train and .../test (the *.json files) to {dest}/train and {dest}/test."
)


def load_femnist(root: str | None = None) -> DatasetBundle:
    """LEAF FEMNIST (62 classes) from ``train/*.json`` and ``test/*.json``.

    Looked for under ``root/femnist/data``, ``root/femnist``, ``root/leaf/data/femnist/data``,
    ``root/leaf/femnist/data`` and ``root``.  LEAF stores each sample as 784 floats in
    [0, 1] (white background = 1); they are stored here as ``uint8`` images
    ``round(x * 255)`` of shape ``(1, 28, 28)`` (exact, since LEAF's values are k/255),
    kind ``"image"`` with mean/std (0.9637,)/(0.1597,).  ``natural_train`` /
    ``natural_test`` hold each writer's indices (``natural_users`` the writer ids).
    """
    r = _root(root)
    train, test = _leaf_load(
        root,
        "femnist",
        _LEAF_HOWTO.format(name="femnist", args="-s niid --sf 0.05 -k 0 -t sample --tf 0.9", dest=r / "femnist"),
    )
    for u, xs, _, path in train + test:  # one array per user: cheap next to the per-sample conversion
        for i, v in enumerate(xs):
            if not isinstance(v, list) or len(v) != 784:
                raise ValueError(f"{path}: LEAF user {u!r}, sample {i}: x must be a list of 784 pixel values, got "
                                 f"{type(v).__name__} of length {len(v) if hasattr(v, '__len__') else '?'}")
        try:
            a = np.asarray(xs, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: LEAF user {u!r}: pixel values are not numbers ({e})") from None
        if a.size and not (np.isfinite(a).all() and a.min() >= 0.0 and a.max() <= 1.0):
            raise ValueError(f"{path}: LEAF user {u!r}: pixel values must lie in [0, 1], found "
                             f"{np.nanmin(a):g}..{np.nanmax(a):g}")

    def label(v):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 62:
            raise ValueError(f"label {v!r} is not an integer in 0..61")
        return v

    users, (xtr, ytr, ptr), (xte, yte, pte) = _leaf_assemble(train, test, lambda v: v, label)

    def to_img(xs):
        a = np.asarray(xs, dtype=np.float32).reshape(-1, 784) if len(xs) else np.zeros((0, 784), np.float32)
        return np.clip(np.rint(a * 255.0), 0, 255).astype(np.uint8).reshape(-1, 1, 28, 28)

    spec = DataSpec("femnist", "image", (1, 28, 28), 62, (0.9637,), (0.1597,))
    return DatasetBundle(spec, to_img(xtr), ytr, to_img(xte), yte, ptr, pte, users)


def load_shakespeare(root: str | None = None) -> DatasetBundle:
    """LEAF Shakespeare next-character prediction.

    ``x`` is an 80-character string mapped with LEAF's ``ALL_LETTERS`` (80 symbols) to
    ``int64`` token ids, ``y`` the next character's id; kind ``"tokens"``, 80 classes,
    ``input_shape=(seq_len,)`` (80 for LEAF).  Characters outside ``ALL_LETTERS``
    (LEAF's ``find`` would give -1) are mapped to the space character with a warning.
    Directory search as for :func:`load_femnist` with ``shakespeare``.
    """
    r = _root(root)
    train, test = _leaf_load(
        root,
        "shakespeare",
        _LEAF_HOWTO.format(name="shakespeare", args="-s niid --sf 0.2 -k 0 -t sample --tf 0.9", dest=r / "shakespeare"),
    )
    lookup = {c: i for i, c in enumerate(LEAF_ALL_LETTERS)}
    unknown = [0]
    space = lookup[" "]

    def enc(c: str) -> int:
        i = lookup.get(c)
        if i is None:
            unknown[0] += 1
            return space
        return i

    def conv_x(s: str) -> list[int]:
        if not isinstance(s, str):
            raise ValueError(f"x must be a string, got {type(s).__name__}")
        return [enc(c) for c in s]

    def conv_y(s: str) -> int:
        if not isinstance(s, str) or len(s) != 1:
            raise ValueError(f"shakespeare: label {s!r} is not a single character")
        return enc(s)

    users, (xtr, ytr, ptr), (xte, yte, pte) = _leaf_assemble(train, test, conv_x, conv_y)
    lengths = {len(s) for s in xtr} | {len(s) for s in xte}
    if len(lengths) > 1:
        raise ValueError(f"shakespeare: sequences have differing lengths {sorted(lengths)}")
    seq_len = lengths.pop() if lengths else 80
    if unknown[0]:
        warnings.warn(f"shakespeare: {unknown[0]} characters outside LEAF's ALL_LETTERS mapped to ' '")

    def arr(xs):
        return np.asarray(xs, dtype=np.int64).reshape(-1, seq_len)

    spec = DataSpec("shakespeare", "tokens", (seq_len,), len(LEAF_ALL_LETTERS))
    return DatasetBundle(spec, arr(xtr), ytr, arr(xte), yte, ptr, pte, users)


# --------------------------------------------------------------------------- synthetic


def load_synthetic(
    root: str | None = None,
    *,
    num_samples: int = 2000,
    num_classes: int = 10,
    shape: tuple = (1, 8, 8),
    seed: int = 0,
    test_fraction: float = 0.2,
    separation: float = 1.0,
) -> DatasetBundle:
    """Deterministic Gaussian-class data (no files; ``root`` ignored).

    ``num_samples`` is the total, split ``1 - test_fraction`` / ``test_fraction``;
    labels are balanced (``i % num_classes``, shuffled).  Class ``c`` has mean
    ``separation * m_c`` with ``m_c ~ N(0, I)`` and unit-variance isotropic noise, so a
    linear model learns it well.  kind ``"float"``.
    """
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    if num_samples < 2 or num_classes < 1:
        raise ValueError("synthetic: need num_samples >= 2 and num_classes >= 1")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"synthetic: test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    dim = int(np.prod(shape))
    means = rng.standard_normal((num_classes, dim)) * separation
    y = rng.permutation(np.arange(num_samples, dtype=np.int64) % num_classes)
    x = (means[y] + rng.standard_normal((num_samples, dim))).astype(np.float32).reshape((num_samples,) + shape)
    n_test = min(num_samples - 1, max(1, int(round(num_samples * test_fraction))))
    n_train = num_samples - n_test
    spec = DataSpec("synthetic", "float", shape, num_classes)
    return DatasetBundle(spec, x[:n_train], y[:n_train], x[n_train:], y[n_train:])


# --------------------------------------------------------------------------- registry

DATASETS: dict[str, Callable[..., DatasetBundle]] = {
    "fashion_mnist": load_fashion_mnist,
    "digits": load_digits,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "svhn": load_svhn,
    "femnist": load_femnist,
    "shakespeare": load_shakespeare,
    "synthetic": load_synthetic,
}


def load_dataset(name: str, root: str | None = None, **kwargs) -> DatasetBundle:
    """Load a registered dataset.  ``root`` defaults to :func:`default_data_root`.

    Unknown names and unknown keyword arguments raise ``ValueError`` naming them.
    """
    key = str(name).strip().lower().replace("-", "_")
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}")
    loader = DATASETS[key]
    params = inspect.signature(loader).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        allowed = [k for k in params if k != "root"]
        bad = sorted(set(kwargs) - set(allowed))
        if bad:
            raise ValueError(
                f"unknown option(s) {bad} for dataset {key!r}; allowed: {allowed or 'none'}"
            )
    return loader(root, **kwargs)
