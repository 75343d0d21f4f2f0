"""What the peer runners share: the Fashion-MNIST files raysplit reads, unpacked where torchvision's
``FashionMNIST(download=False)`` looks for them; and how a copy of eejiarong/GAS finds its data and its ``utils``
(benchmarks/peers/gas/run.py and benchmarks/gas_vs_authors.py)."""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from pathlib import Path

FMNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                "t10k-labels-idx1-ubyte")


def fmnist_raw(files: list[str], name: str) -> Path:
    """torchvision's FashionMNIST(download=False) reads uncompressed IDX files from <root>/FashionMNIST/raw; unpack
    the files raysplit read (the Debian package's .gz) once into a cache under /tmp (``name``: the runner's folder
    there); returns the root."""
    cache = Path(tempfile.gettempdir()) / name
    raw = cache / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for f in files:
        base = Path(f).name.removesuffix(".gz")
        if base not in FMNIST_FILES:
            continue
        dst = raw / base
        if not dst.exists():
            tmp = dst.with_suffix(".part")
            with (gzip.open(f, "rb") if f.endswith(".gz") else open(f, "rb")) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out)
            tmp.rename(dst)
    missing = [f for f in FMNIST_FILES if not (raw / f).exists()]
    if missing:
        raise SystemExit(f"Fashion-MNIST files missing in {raw}: {missing}")
    return cache


def gas_data(code: Path, files: list[str]) -> Path:
    """eejiarong/GAS's ``utils/dataset.py`` reads torchvision's layout under ``../data``, relative to the working
    directory, which is the folder of ``GAS_main.py`` (``code``): link ``code.parent / "data"`` to the unpacked
    Fashion-MNIST ``files`` (:func:`fmnist_raw`, cached under /tmp/gas_peer_data). Returns the link."""
    link = Path(code).parent / "data"
    if not link.exists():
        link.symlink_to(fmnist_raw(files, "gas_peer_data"), target_is_directory=True)
    return link


def gas_env(code: Path, **extra: str) -> dict[str, str]:
    """The environment to run ``GAS_main.py`` in: it appends ``<its folder's parent>/utils`` to ``sys.path``, a
    folder that does not exist (its ``utils/`` lies beside it), so ``code/utils`` goes on PYTHONPATH; ``extra``:
    further variables."""
    path = [str(Path(code) / "utils")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), **extra)
