"""Where a host computes and how fast: its torch device (``runtime.server.device`` / ``runtime.client.device``),
deterministic kernels, the CPU's kind and kernel set, the machine's cores and GPUs, thread limits."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import threadpoolctl
import torch

from raysplit.errors import ConfigError


def host_device(want: str, key: str) -> torch.device:
    """The torch device a host computes on: ``want`` (``key``'s value: auto, cpu, cuda) against the GPUs this
    process sees (under Ray: the actor's own); ``cuda`` where there is none is a ConfigError naming ``key``."""
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda: this process sees no CUDA device (torch {torch.__version__}, CUDA "
                          f"{torch.version.cuda or 'not built in'}); use auto or cpu")
    return torch.device("cuda" if want in ("auto", "cuda") and torch.cuda.is_available() else "cpu")


def _cpuinfo(field: str) -> str | None:
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return None
    return next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                 if line.startswith(field)), None)


def native_capability() -> str | None:
    """The widest CPU kernel set torch could use here (from the CPU's flags: what ``get_cpu_capability`` gives when
    nothing lowers it); None where /proc/cpuinfo is not there."""
    flags = set((_cpuinfo("flags") or "").split())
    if not flags:
        return None
    return "AVX512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else \
        "AVX2" if {"avx2", "fma"} <= flags else "DEFAULT"


# Environment variables that make torch, oneDNN and MKL compute with a narrower kernel set than the CPU has, by the
# kernel set to pin (set before torch is imported, in every process of a run: Ray's workers inherit a local
# driver's environment). Measured (docs/reliability.md, "Same config and seed, same metrics"): on an AVX-512 machine
# all four together bring the quickstart's figures to within .001 of an AVX2 machine's; ATEN_CPU_CAPABILITY alone
# does not.
KERNEL_ENV = {
    "AVX2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "MKL_CBWR": "AVX2"},
    "DEFAULT": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                "MKL_CBWR": "COMPATIBLE"},
}


@functools.lru_cache(maxsize=1)
def cpu_kind() -> str:
    """This process's CPU model and torch's CPU kernel set (``torch.backends.cpu.get_cpu_capability``; "lowered from"
    the CPU's own where the environment pins a narrower one, :data:`KERNEL_ENV`): what decides how float sums round
    on a CPU, so the kind of machine on which a run's metrics repeat digit for digit (logged as ``resolved.cpu``)."""
    import platform

    model = _cpuinfo("model name") or platform.processor() or platform.machine()
    cap, native = torch.backends.cpu.get_cpu_capability(), native_capability()
    return f"{model}, {cap}" + (f" (lowered from {native})" if native and native != cap else "")


def host_device_of(host) -> str:
    """The device a built host computes on: a server host's ``device``, a client host's executor's."""
    device = getattr(host, "device", None)
    return str(device if device is not None else host.executor.device)


def set_determinism(want: bool | str, device: torch.device) -> bool:
    """``runtime.deterministic`` in this process: deterministic kernels (``torch.use_deterministic_algorithms``,
    cuDNN's deterministic algorithms and no autotuning, a fixed cuBLAS workspace) where ``want`` is true, or
    ``auto`` and the host computes on a GPU; on the CPU at a fixed thread count the kernels already are, and
    ``auto`` leaves them alone. Returns whether it is on."""
    on = want is True or (want == "auto" and device.type == "cuda")
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts its first handle
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)
    return on


def determinism_state() -> dict:
    """This process's kernel settings that :func:`set_determinism` changes, to put back with
    :func:`restore_determinism` once a run is over (a later run in the process must not inherit them)."""
    return {"algorithms": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic, "cudnn_benchmark": torch.backends.cudnn.benchmark}


def restore_determinism(state: dict) -> None:
    """The settings :func:`determinism_state` read, back in force."""
    torch.use_deterministic_algorithms(state["algorithms"], warn_only=state["warn_only"])
    torch.backends.cudnn.deterministic = state["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = state["cudnn_benchmark"]


def device_rng_state(device: torch.device):
    """The random state of ``device``'s generator (a GPU's: what its dropout draws from), None on the CPU (torch's
    CPU state is saved on its own); a checkpoint carries it so that a restored run draws what the run would have."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_device_rng_state(device: torch.device, state) -> None:
    if state is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state, device)


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed torch's CPU generator and, on a GPU, ``device``'s: what ``torch.manual_seed`` does for the generators a
    host draws from, without its calls into every accelerator module, which on a machine where CUDA is not
    initialised each queue a lazy call with a formatted stack trace (about 0.3 ms a client step, measured by
    benchmarks/step_cost.py's profile)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None
                                      else torch.cuda.current_device()].manual_seed(seed)


def counting_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` on the CPU for counting FLOPs and shapes (which its weights do not change): its weights
    copied, or left uninitialised where it lives on the ``meta`` device (only shapes there). What a cost model runs,
    so that it never mixes the host's accelerator with tensors it makes itself."""
    import itertools

    from raysplit.models.adapters import copy_sharing_base

    m = copy_sharing_base(module)  # a language model's frozen base shared, not copied (on the CPU already)
    if any(t.is_meta for t in itertools.chain(m.parameters(), m.buffers())):
        return m.to_empty(device="cpu")
    return m.cpu()


def machine_cores() -> int:
    """The CPU cores this process may run on (its affinity; all of the machine's where that is not known)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_local_gpus(rcfg) -> None:
    """A ConfigError naming the keys unless this machine has the GPUs the run's actors ask for
    (``runtime.server.num_gpus`` + ``num_workers`` x ``runtime.client.num_gpus``): for a private local Ray, checked
    before it starts."""
    need = rcfg.server.num_gpus + rcfg.num_workers * rcfg.client.num_gpus
    if need and need > (have := torch.cuda.device_count()) + 1e-9:  # CUDA is not asked when no GPU is
        raise ConfigError(f"runtime.server.num_gpus={rcfg.server.num_gpus:g} and runtime.client.num_gpus="
                          f"{rcfg.client.num_gpus:g} (x {rcfg.num_workers} client actors) ask for {need:g} GPU(s); this "
                          f"machine has {have}. Set them to 0 here, or give runtime.address to join a Ray cluster with "
                          "GPUs")


def limit_threads(n: int | str) -> None:
    """``n`` threads for torch (``"auto"``, for a host built outside a backend: the machine's cores), one for the
    BLAS libraries under numpy and scipy (threadpoolctl). Ray sets
    OMP_NUM_THREADS only in actors, so an in-process host (the local backend) would otherwise run OpenBLAS with a
    thread per core, and OpenBLAS threads that meet busy cores spin: GAS's factor update (``stpqrt`` on a 3,136 x
    3,136 factor) took 64 s with 2 threads on the loaded 2-core machine and 0.13 s with 1. The numpy/scipy work
    of the hosts (GAS's statistics, Ampere's shards) is small next to torch's, so it keeps one thread whatever
    ``runtime.torch_threads`` gives torch. Only the BLAS pools are limited (``user_api="blas"``): a limit on every
    pool also reached torch's OpenMP pool and could take torch back to one thread, whatever it was given."""
    torch.set_num_threads(machine_cores() if n == "auto" else n)
    threadpoolctl.threadpool_limits(1, user_api="blas")
