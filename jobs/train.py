"""Ray Jobs entry point: the same code path as ``raysplit run``, attached to the running cluster.

    ray job submit --address http://HEAD:8265 --working-dir . --runtime-env jobs/runtime_env.yaml \
        -- python jobs/train.py configs/quickstart.yaml train.rounds=5

The job joins the cluster it was submitted to (``runtime.address=auto``) and never starts a Ray of its own.
MLflow: set ``tracking.uri`` (or MLFLOW_TRACKING_URI in the runtime_env) to a server every node can reach;
the default sqlite file would land in the job's working directory on the head node.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the uploaded working_dir holds raysplit/

from raysplit.cli import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a.startswith("runtime.address=") for a in args):
        args.append("runtime.address=auto")
    sys.exit(main(["run", *args]))
