"""``make gpu-bundle`` (issue 70 item 4): the wheels the GPU machine lacks, for its Python (3.12: ``.gpu-bundle/cp312``)
and for this machine's (3.11: ``.gpu-bundle/cp311``, what ``make rehearse-gpu`` installs), in the ignored folder
``.gpu-bundle/``.

The GPU machine has torch, numpy, pandas, pyarrow, scipy, PyYAML, tqdm and threadpoolctl but no Ray, pydantic or
MLflow, reaches no package registry and receives at most 64 MiB of files. So a bundle holds:

- Ray (requirements.txt's pin) with the parts raysplit never imports taken out of the wheel (:data:`STRIP`: the
  Java jars, the dashboard's web client, RLlib, Serve, Ray LLM, Ray Data), its RECORD rewritten to match;
- pydantic and pydantic-core (requirements.txt's pins), tqdm and threadpoolctl (a bare environment lacks them);
- what those need, resolved by pip for that Python and platform (``pip download --only-binary=:all:``);
- raysplit's own wheel (built from this checkout; installed with ``--no-deps``: its pins name the CPU machine's torch);
- ``requirements.txt`` (what ``benchmarks/gpu_run.sh`` installs from the folder, ``--no-index``) and
  ``manifest.json`` (versions, sizes, the commit the raysplit wheel was built from).

MLflow is not in it: the benchmark runs with tracking off. Downloads are kept in ``.gpu-bundle/downloads/`` and
reused; the raysplit wheel is rebuilt every time. The cp312 bundle must stay under ``--max-mb`` (60 MiB: it travels
with the working tree, 64 MiB in all); the script fails naming its size when it does not.

    python scripts/gpu_bundle.py [--pythons 3.12 3.11] [--max-mb 60]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / ".gpu-bundle"
PINNED = ("ray", "pydantic", "tqdm", "threadpoolctl")  # versions from requirements.txt
# parts of the Ray wheel that nothing raysplit runs imports or starts (checked: make rehearse-gpu runs every arm)
STRIP = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/serve/", "ray/llm/", "ray/data/")


def pins() -> list[str]:
    """``name==version`` for :data:`PINNED`, read from requirements.txt (the tested set)."""
    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        req = line.split("#")[0].strip()
        if "==" in req:
            name, version = req.split("==")
            found[name.split("[")[0].strip().lower()] = version.strip()
    return [f"{name}=={found[name]}" for name in PINNED] + ["pydantic-core"]


def pip_env() -> dict:
    """pip as a bare machine has it: PyPI alone (no local wheel folders, no constraints of this machine's config)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def download(version: str, dest: Path) -> None:
    tag = version.replace(".", "")
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", version,
           "--implementation", "cp", "--abi", f"cp{tag}", "--platform", "manylinux2014_x86_64",
           "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", "-d", str(dest), *pins()]
    subprocess.run(cmd, check=True, env=pip_env())


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def strip_ray(src: Path, dest: Path) -> dict:
    """``src``'s Ray wheel without :data:`STRIP`'s folders, its RECORD listing what is left."""
    kept, dropped = 0, 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in zin.infolist():
            if info.filename.startswith(STRIP):
                dropped += info.file_size
                continue
            if info.filename == record_name:
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
            if not info.is_dir():
                lines.append(record_line(info.filename, data))
            kept += info.file_size
        lines.append(f"{record_name},,")
        zout.writestr(record_name, "\n".join(lines) + "\n")
    return {"kept_mb": round(kept / 2**20, 1), "stripped_mb": round(dropped / 2**20, 1)}


def raysplit_wheel(dest: Path) -> Path:
    """raysplit's wheel, built from a copy of its sources (setuptools would leave build/ in the checkout, and
    build/ would travel with the working tree)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(ROOT / "raysplit", src / "raysplit", ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp,
                        str(src)], check=True, env=pip_env())
        (wheel,) = Path(tmp).glob("raysplit-*.whl")
        return Path(shutil.copy2(wheel, dest / wheel.name))


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "raysplit", "pyproject.toml"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except OSError:
        return "unknown"


def build(version: str) -> dict:
    tag = "cp" + version.replace(".", "")
    downloads, out = BUNDLE / "downloads" / tag, BUNDLE / tag
    wanted = " ".join(pins())
    stamp = downloads / ".wanted"
    if not (stamp.exists() and stamp.read_text() == wanted):
        shutil.rmtree(downloads, ignore_errors=True)
        download(version, downloads)
        stamp.write_text(wanted)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ray_info = {}
    names = []
    for wheel in sorted(downloads.glob("*.whl")):
        if wheel.name.startswith("ray-"):
            ray_info = strip_ray(wheel, out / wheel.name)
        else:
            shutil.copy2(wheel, out / wheel.name)
        names.append(wheel.name.split("-")[0].replace("_", "-").lower())
    own = raysplit_wheel(out)
    (out / "requirements.txt").write_text("\n".join(pins()) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    manifest = {"python": version, "wheels": sorted(f.name for f in out.glob("*.whl")), "ray": ray_info,
                "raysplit_wheel": own.name, "raysplit_commit": commit(), "strip": list(STRIP),
                "size_mb": round(size / 2**20, 1)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pythons", nargs="+", default=["3.12", "3.11"])
    ap.add_argument("--max-mb", type=float, default=60.0, help="the most the cp312 bundle may weigh (MiB)")
    a = ap.parse_args(argv)
    failed = False
    for version in a.pythons:
        m = build(version)
        print(f".gpu-bundle/cp{version.replace('.', '')}: {m['size_mb']} MiB, {len(m['wheels'])} wheels "
              f"(Ray {m['ray'].get('kept_mb')} MiB unpacked, {m['ray'].get('stripped_mb')} MiB stripped), "
              f"raysplit from {m['raysplit_commit'][:12]}", flush=True)
        if version == "3.12" and m["size_mb"] > a.max_mb:
            print(f"gpu-bundle: the cp312 bundle is {m['size_mb']} MiB, over {a.max_mb} MiB", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
