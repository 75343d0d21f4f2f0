"""Runs one of Hydra's scripts unchanged, as ``python script.py ARGS`` would, after seeding the global RNGs their
code draws from (they set none: ``random`` for the cycle order and the random policy, torch for the weights and the
DataLoader shuffles). Started by run.py with the temporary copy of their repository as the working directory.

    python _driver.py SEED THREADS SCRIPT [their args...]
"""

import os
import random
import runpy
import sys

import numpy as np
import torch

seed, threads, script, args = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
random.seed(seed)
np.random.seed(seed)
torch.manual_seed(seed)
if threads > 0:
    torch.set_num_threads(threads)
sys.path.insert(0, os.getcwd())
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
