#!/usr/bin/env bash
# flwr 1.41.0: 1.42.0 needs a certifi release the package registry does not have yet.
# Flower's Ray simulation in its own venv (benchmarks/.flower-venv, git-ignored): flwr[simulation] pins a Ray other
# than raysplit's. torch comes from the same pinned wheel as raysplit's venv; the benchmark imports raysplit's data
# and model code from the repository (plain torch/numpy, no Ray), so both sides train the identical model.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.flower-venv"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
"$venv/bin/pip" install -q -U pip
"$venv/bin/pip" install -q "flwr[simulation]==1.41.0" "torch==2.14.1" "torchvision==0.29.1" "pydantic>=2" "pyyaml" "psutil"
"$venv/bin/python" -c "import flwr, ray, torch; print('flwr', flwr.__version__, 'ray', ray.__version__, 'torch', torch.__version__)"
