#!/usr/bin/env bash
# Set up, then run the tests. "No tests ran" is a failure.
#   bash scripts/test.sh          the fast tier (unit and semantic tests, every algorithm end to end on the local
#                                 backend with its golden fingerprint, one Ray run per loop family and transport)
#   bash scripts/test.sh --all    the full tier (adds in-process Ray, multi-node clusters, job submission, MLflow
#                                 servers, fault injection, subprocess kills, heavy models): what CI runs
#   bash scripts/test.sh --full-only   only what the full tier adds (CI runs the fast tier, then this, timing each)
# Any other argument goes to pytest (e.g. -k gas, tests/test_golden.py). RAYSPLIT_SETUP_DONE=1 skips the setup
# (.ci/run sets it after its own setup phase).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${RAYSPLIT_SETUP_DONE:-}" = 1 ] || bash scripts/setup.sh
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
       MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false PYTHONDONTWRITEBYTECODE=1
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
