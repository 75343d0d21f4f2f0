"""How tensors cross the object store: one place, chosen by measurement.

On this stack torch tensors cross Ray's object store as serialized copies (~150-500 MB/s, stack.md §4) while numpy
arrays are read back zero-copy; benchmarks/transport.py measures both (``make bench-numpy-torch``; figures in
benchmarks/archive/RESULTS-2026-11-22-to-25.md, "Transport"). Activations,
gradients and model states therefore travel as numpy arrays and become tensors again on arrival with
``torch.from_numpy``. Arrays that ``ray.get`` returns are read-only views of the object store, which torch cannot
wrap safely, so :func:`unpack` copies every read-only array (and a writable one only when asked to); writable
arrays (the local backend, in-process) are wrapped without a copy.
"""

from __future__ import annotations

import numpy as np
import torch


def pack(t: torch.Tensor) -> np.ndarray:
    """Tensor -> numpy for the object store (detached, on CPU, contiguous)."""
    return t.detach().cpu().contiguous().numpy()


def unpack(a: np.ndarray, device: torch.device | str = "cpu", writable: bool = False) -> torch.Tensor:
    """numpy -> tensor: read-only arrays (from ``ray.get``) are copied, writable ones shared unless ``writable``."""
    if writable or not a.flags.writeable:
        a = np.array(a, copy=True)
    return torch.from_numpy(a).to(device)


def pack_state(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: pack(v) for k, v in state.items()}


def unpack_state(state: dict[str, np.ndarray], device="cpu") -> dict[str, torch.Tensor]:
    return {k: unpack(v, device) for k, v in state.items()}


def state_nbytes(state: dict) -> int:
    return int(sum(np.asarray(v).nbytes if not isinstance(v, torch.Tensor) else v.element_size() * v.nelement()
                   for v in state.values()))
