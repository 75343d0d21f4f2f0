#!/usr/bin/env bash
# Set up, then run the quickstart experiment (configs/quickstart.yaml): SFLV2, Fashion-MNIST, 20 clients.
# Data: the Debian package (installed by setup.sh) -> torchvision's download into the data root -> the bundled
# scikit-learn digits, with a note saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=0
EXTRA=()
if ! .venv/bin/python -c "from raysplit.data import load_dataset; load_dataset('fashion_mnist')" >/dev/null 2>&1; then
  ROOT=$(.venv/bin/python -c "from raysplit.data import default_data_root; print(default_data_root())")
  echo "Fashion-MNIST is not installed; trying torchvision's download into $ROOT/FashionMNIST ..."
  if ! .venv/bin/python -c "import torchvision, sys; torchvision.datasets.FashionMNIST(sys.argv[1], download=True)" "$ROOT" >/dev/null 2>&1 \
     || ! .venv/bin/python -c "from raysplit.data import load_dataset; load_dataset('fashion_mnist')" >/dev/null 2>&1; then
    echo "NOTE: Fashion-MNIST is unavailable (no apt package, no download); running the quickstart on the bundled"
    echo "      scikit-learn digits instead (data.dataset=digits). The figures in docs/quickstart.md refer to Fashion-MNIST."
    EXTRA=(data.dataset=digits)
  fi
fi
exec .venv/bin/raysplit run configs/quickstart.yaml "${EXTRA[@]}" "$@"
