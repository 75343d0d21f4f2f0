"""Ray Tune sweeps: ``python tune/sweep.py SWEEP.yaml [key=value ...]`` (same as ``raysplit sweep``).

The implementation and the sweep-file format are in ``raysplit/tuning.py``; examples are in ``tune/examples/``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raysplit.tuning import main

if __name__ == "__main__":
    sys.exit(main())
