"""Ray Jobs entry point for sweeps: ``raysplit sweep`` attached to the running cluster.

    ray job submit --address http://HEAD:8265 --working-dir . --runtime-env jobs/runtime_env.yaml \
        -- python jobs/sweep.py tune/examples/digits_grid.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raysplit.tuning import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a.startswith("runtime.address=") for a in args):
        args.append("runtime.address=auto")
    sys.exit(main(args))
