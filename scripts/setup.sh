#!/usr/bin/env bash
# Install raysplit and its pinned CPU requirement set into ./.venv, plus Fashion-MNIST and the fortunes text corpus
# (the language models' offline default, raysplit/data/text.py) from Debian when apt exists.
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
.venv/bin/python -c "import torch, torchvision, ray, mlflow, transformers, peft, tokenizers, raysplit; print('raysplit', raysplit.__version__, '| torch', torch.__version__, '| ray', ray.__version__, '| mlflow', mlflow.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"

# apt_data MARKER NOTE PACKAGE...: install the Debian data packages unless MARKER (a file they install) exists;
# a failure is a note, not an error (the loaders say where else the data can come from)
apt_data() {
  local marker=$1 note=$2
  shift 2
  if [ ! -f "$marker" ] && command -v apt-get >/dev/null 2>&1; then
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    echo "installing Debian package(s) $* ..."
    if ! ($sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@") >/dev/null 2>&1; then
      echo "note: could not install $* with apt ($note)"
    fi
  fi
}
apt_data /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz "the quickstart will try other sources" \
  dataset-fashion-mnist
apt_data /usr/share/games/fortunes/riddles "language models then need data.text.corpus: files" fortunes-min fortunes
