#!/usr/bin/env bash
# Install raysplit and its pinned CPU requirement set into ./.venv, plus Fashion-MNIST from Debian when apt exists.
# Idempotent: a second run only checks. Needs python3 (with venv) and, for the data, apt (as root or via sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -U pip 2>&1 | grep -v "is ignored: it is neither" || true
# pip (not uv/poetry): it takes the on-disk torch wheels; one pinned set (see requirements.txt)
.venv/bin/pip install -q --disable-pip-version-check -r requirements.txt 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c "import torch, torchvision, ray, mlflow, raysplit; print('raysplit', raysplit.__version__, '| torch', torch.__version__, '| ray', ray.__version__, '| mlflow', mlflow.__version__)"

FMNIST=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
if [ ! -f "$FMNIST" ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  echo "installing Debian package dataset-fashion-mnist ..."
  if ! ($SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1; then
    echo "note: could not install dataset-fashion-mnist with apt (the quickstart will try other sources)"
  fi
fi
