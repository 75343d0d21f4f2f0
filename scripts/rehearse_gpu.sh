#!/usr/bin/env bash
# make rehearse-gpu (issue 70 item 4; a phase of .ci/run): the GPU machine's command, benchmarks/gpu_run.sh, run
# here the way it runs there, at toy size on the CPU, so that it cannot rot:
# - "the machine": a fresh venv holding only torch, numpy, pandas, pyarrow, PyYAML and scipy (with what they need),
#   linked from the project's .venv (no torchvision, Ray, pydantic, MLflow, tqdm; nothing downloaded);
# - the cp311 bundle (make gpu-bundle, built first; its cp312 twin checked against its size limit) installed by
#   gpu_run.sh into a venv over that machine, without an index; a stand-in GAS_main.py as the authors' checkout;
# - every arm's JSON checked (bench_gpu.py --check): present, and no arm failed or skipped.
# Everything lives in the ignored .gpu-bundle/ (downloads kept there between runs).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
PY=${PY:-.venv/bin/python}
rehearsal=.gpu-bundle/rehearsal
"$PY" scripts/gpu_bundle.py
rm -rf "$rehearsal"
mkdir -p "$rehearsal"
base=$("$PY" -c 'import sys; print(sys._base_executable)')
"$base" -m venv "$rehearsal/machine"
site=$("$rehearsal/machine/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" - "$site" <<'EOF'
"""Link the six packages the GPU machine is said to have, and what they require, into the bare venv's site-packages."""
import importlib.metadata as md
import os
import sys
from pathlib import Path

from packaging.requirements import Requirement

site, todo, seen = Path(sys.argv[1]), ["torch", "numpy", "pandas", "pyarrow", "PyYAML", "scipy"], {}
while todo:
    name = todo.pop()
    key = name.lower().replace("_", "-")
    if key in seen:
        continue
    dist = seen[key] = md.distribution(name)
    for req in dist.requires or []:
        r = Requirement(req)
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            todo.append(r.name)
tops = set()
for dist in seen.values():
    for f in dist.files or []:
        parts = Path(f).parts
        if parts and parts[0] != ".." and not parts[0].endswith(".pth") and parts[0] != "__pycache__":
            tops.add(Path(dist.locate_file(parts[0])))
for top in sorted(tops):
    if top.exists() and not (site / top.name).exists():
        os.symlink(top, site / top.name)
print(f"rehearse-gpu: the machine has {len(seen)} distributions: {', '.join(sorted(seen))}")
EOF
# a stand-in for the authors' GAS checkout: a GAS_main.py that logs rounds and then runs on (the real one travels
# from outside the project)
mkdir -p "$rehearsal/GAS"
printf 'import time\nfor r in range(3):\n    print(f"Round {r} acc 0.1", flush=True)\ntime.sleep(60)\n' \
  > "$rehearsal/GAS/GAS_main.py"
GPU_PYTHON="$rehearsal/machine/bin/python" GPU_VENV="$rehearsal/venv" GPU_BUNDLE=.gpu-bundle/cp311 \
  bash benchmarks/gpu_run.sh "$rehearsal/out" --toy --gas-checkout "$rehearsal/GAS"
"$PY" benchmarks/bench_gpu.py --dry-run --check "$rehearsal/out" --gas-checkout "$rehearsal/GAS"
echo "rehearse-gpu: passed in $(( $(date +%s) - t0 )) s"
