"""Ampere's activation store: .npy shards (raysplit/data/store.py) against Parquet shards, on the local disk.

    .venv/bin/python benchmarks/store.py [--rows 12000] [--shape 32 14 14] [--chunk 1024] [--devices 10]
                                         [--caches 1.0 0.25 0.0625] [--repeats 3]

Writes a store the way Ampere's transfer does (``--devices`` sources, chunks of ``--chunk`` rows of float32
activations of ``--shape``, default cnn_small's conv1 output on Fashion-MNIST), then reads one shuffled epoch in
batches of 64 with the cache at each fraction of the store's size, three ways:

- npy: ``ActivationStore`` + ``ShuffledLoader`` as Ampere uses them (each group reads only its rows of every
  shard through a memory map);
- parquet / parquet-snappy: the same shards as Parquet files (one FixedSizeList<float32> column, one int64
  column, pyarrow, no compression or snappy); a group must decode every shard whole and then take its rows, so a
  cache of 1/G of the store reads the store G times (no prefetch thread, and each group ends in a partial batch).

Prints write seconds and MB/s, bytes on disk, epoch seconds per cache fraction (median of ``--repeats``) and the
loader's peak rows in memory; writes benchmarks/out/store.json and logs to the MLflow experiment ``benchmarks``.
The page cache is warm after the write (the machine has far more RAM than the store), so this measures decode and
copy costs, not the disk.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load, log_mlflow, mmm, save
from raysplit.data.store import ActivationStore, ShuffledLoader


def chunks(rows: int, shape: tuple[int, ...], chunk: int, devices: int):
    rng = np.random.default_rng(0)
    per = rows // devices
    for d in range(devices):
        for lo in range(0, per, chunk):
            n = min(chunk, per - lo)
            yield d, rng.standard_normal((n, *shape), dtype=np.float32), rng.integers(0, 10, n)


def write_npy(path: Path, data) -> ActivationStore:
    store = ActivationStore(path)
    for d, x, y in data:
        store.append(x, y, d)
    store.seal()
    return store


def write_parquet(path: Path, data, compression: str | None) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(parents=True)
    files = []
    for i, (_, x, y) in enumerate(data):
        flat = pa.array(x.reshape(-1), type=pa.float32())
        col = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(x.shape[1:])))
        f = path / f"shard{i:06d}.parquet"
        pq.write_table(pa.table({"x": col, "y": pa.array(y, type=pa.int64())}), f, compression=compression)
        files.append(f)
    return files


def epoch_parquet(files: list[Path], shape, batch: int, groups_n: int, seed: int) -> tuple[int, int]:
    """One shuffled epoch over Parquet shards in ``groups_n`` groups (each a slice of every shard); returns
    (batches, peak rows held)."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    rows = [pq.ParquetFile(f).metadata.num_rows for f in files]
    slices = [np.array_split(rng.permutation(n), groups_n) for n in rows]
    batches, peak = 0, 0
    for g in range(groups_n):
        xs, ys = [], []
        for f, sl in zip(files, slices):
            t = pq.read_table(f)
            x = t.column("x").combine_chunks().values.to_numpy().reshape(-1, *shape)
            xs.append(x[np.sort(sl[g])])
            ys.append(t.column("y").to_numpy()[np.sort(sl[g])])
        x, y = np.concatenate(xs), np.concatenate(ys)
        peak = max(peak, len(y))
        order = rng.permutation(len(y))
        for lo in range(0, len(y), batch):
            idx = order[lo:lo + batch]
            _ = x[idx], y[idx]
            batches += 1
    return batches, peak


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=12000)
    ap.add_argument("--shape", type=int, nargs="+", default=[32, 14, 14])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--caches", type=float, nargs="+", default=[1.0, 0.25, 0.0625])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    shape = tuple(args.shape)
    base = Path(tempfile.mkdtemp(prefix="raysplit-store-bench-"))
    res: dict = {"rows": args.rows, "shape": shape, "chunk": args.chunk, "devices": args.devices,
                 "load_before": load(), "formats": {}}
    try:
        data = list(chunks(args.rows, shape, args.chunk, args.devices))
        raw = sum(x.nbytes + y.size * 8 for _, x, y in data)
        res["raw_mb"] = raw / 1e6
        for fmt in ("npy", "parquet", "parquet-snappy"):
            path = base / fmt
            t0 = time.perf_counter()
            if fmt == "npy":
                store = write_npy(path, data)
            else:
                files = write_parquet(path, data, "snappy" if fmt.endswith("snappy") else None)
            wt = time.perf_counter() - t0
            out = {"write_s": wt, "write_mb_s": raw / 1e6 / wt, "disk_mb": du(path) / 1e6, "epochs": {}}
            for frac in args.caches:
                cache = int(raw * frac)
                times, peak = [], 0
                for rep in range(args.repeats):
                    t0 = time.perf_counter()
                    if fmt == "npy":
                        loader = ShuffledLoader(store, args.batch, cache, seed=rep)
                        n = sum(1 for _ in loader.epoch(0))
                        peak = loader.peak_bytes
                    else:
                        groups_n = max(1, -(-raw // (cache // 2)))  # as many groups as the npy loader makes
                        n, rows = epoch_parquet(files, shape, args.batch, groups_n, rep)
                        peak = (rows + args.chunk) * raw // args.rows  # a group plus the shard decoded whole
                    times.append(time.perf_counter() - t0)
                out["epochs"][str(frac)] = {"seconds": mmm(times), "batches": n, "peak_mb": peak / 1e6}
                print(f"{fmt:15s} cache {frac:>7.4f} of the store: epoch {np.median(times):6.2f} s "
                      f"({n} batches), peak {peak / 1e6:7.1f} MB", flush=True)
            print(f"{fmt:15s} write {wt:.2f} s ({raw / 1e6 / wt:.0f} MB/s), on disk {out['disk_mb']:.1f} MB "
                  f"(raw {raw / 1e6:.1f} MB)", flush=True)
            res["formats"][fmt] = out
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res["load_after"] = load()
    path = save("store", res)
    metrics = {f"{f}_write_s": v["write_s"] for f, v in res["formats"].items()}
    metrics.update({f"{f}_epoch_s_cache{c}": e["seconds"]["median"] for f, v in res["formats"].items()
                    for c, e in v["epochs"].items()})
    log_mlflow("store", {"rows": args.rows, "shape": shape, "chunk": args.chunk}, metrics, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
