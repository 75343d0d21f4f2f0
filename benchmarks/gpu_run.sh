#!/usr/bin/env bash
# The GPU machine's one command (issue 70 item 4): install the wheel bundle (make gpu-bundle, carried as
# .gpu-bundle/cp312) without a registry into a venv over the machine's packages, then benchmarks/bench_gpu.py's pre-flight checks and trimmed benchmark,
# all within about 9 minutes, every arm's JSON written into OUT as it finishes (a failed arm recorded, not fatal).
#
#   bash benchmarks/gpu_run.sh OUT [--gas-checkout DIR] [--toy]
#
# OUT gets preflight.json (versions, CUDA, a one-step round of each layout), plain.json, local.json, packed.json,
# clients-gpu.json, gas.json and run.log: 7 files (the device call brings back 8 at most).
# --toy: the same at toy size on the CPU (make rehearse-gpu). The environment may name GPU_PYTHON (the machine's
# python3, whose torch is used), GPU_BUNDLE (default .gpu-bundle/cpXY for that Python), GPU_VENV (default
# /tmp/raysplit-gpu-venv) and GPU_BUDGET_S (540: the whole command's seconds, install included).
set -uo pipefail
cd "$(dirname "$0")/.."
unset PYTHONPATH  # raysplit comes from the bundle's wheel, not from this checkout (make exports the checkout)
out=${1:?usage: bash benchmarks/gpu_run.sh OUT [--gas-checkout DIR] [--toy]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee -a "$out/run.log") 2>&1
extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --gas-checkout)
      [ -f "${2:-}/GAS_main.py" ] || { echo "gpu_run: no GAS_main.py in '${2:-}'"; exit 2; }
      extra+=(--gas-checkout "$(cd "$2" && pwd)"); shift 2 ;;
    --toy) extra+=(--dry-run); shift ;;
    *) echo "gpu_run: unknown argument $1"; exit 2 ;;
  esac
done
t0=$(date +%s)
py=${GPU_PYTHON:-python3}
tag=cp$("$py" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
bundle=${GPU_BUNDLE:-.gpu-bundle/$tag}
venv=${GPU_VENV:-/tmp/raysplit-gpu-venv}
budget=${GPU_BUDGET_S:-540}
[ -f "$bundle/requirements.txt" ] || { echo "gpu_run: no bundle at $bundle (make gpu-bundle here, then carry it)"; exit 2; }
# pip as on a machine without a registry: this folder alone, no index, no configured links or constraints
nopip=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null
       PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1)

echo "gpu_run: $("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])'), bundle $bundle, venv $venv"
rm -rf "$venv"
if "$py" -m venv "$venv" 2>/dev/null; then
  pip=("$venv/bin/python" -m pip)
else  # a Python without ensurepip: the machine's pip installs into the venv
  "$py" -m venv --without-pip "$venv" || exit 2
  pip=("$py" -m pip --python "$venv/bin/python")
fi
# The venv sees the machine's packages (its torch) after its own: the site folders the machine's python3 sees, in
# a .pth. Not --system-site-packages: where python3 is itself a venv (the GPU machine's /opt/torch/.venv), that
# reaches the Python under it and not the venv's torch.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$py" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
  > "$site/zz_machine_site.pth"
"${nopip[@]}" "${pip[@]}" install -q --no-index --find-links "$bundle" -r "$bundle/requirements.txt" || exit 2
"${nopip[@]}" "${pip[@]}" install -q --no-index --no-deps "$bundle"/raysplit-*.whl || exit 2
echo "gpu_run: installed in $(( $(date +%s) - t0 )) s"

left=$(( budget - ($(date +%s) - t0) ))
# the benchmark starts no run in its last minute; what is still running at the budget's end is stopped, and every
# arm finished by then is in OUT.
env RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 GPU_BUNDLE="$bundle" \
  timeout --signal=TERM --kill-after=15 "$left" "$venv/bin/python" benchmarks/bench_gpu.py --preflight \
  --out-dir "$out" --budget-s $(( left - 60 )) "${extra[@]}"
rc=$?
[ "$rc" = 124 ] && echo "gpu_run: stopped at the budget's end ($budget s); the arms finished by then are in $out"
echo "gpu_run: exit $rc after $(( $(date +%s) - t0 )) s; $(ls "$out" | tr '\n' ' ')"
exit "$rc"
