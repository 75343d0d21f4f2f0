"""What the peer runners share: the Fashion-MNIST files raysplit reads, unpacked where torchvision's
``FashionMNIST(download=False)`` looks for them."""

from __future__ import annotations

import gzip
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
