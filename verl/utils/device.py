"""One place that knows which accelerator this process runs on.

Supported back ends: CUDA (incl. ROCm builds of torch), Ascend NPU through the
optional ``torch_npu`` plugin, and plain CPU. ``torch_npu`` is only imported
when it is installed, and only the first time NPU support is asked about.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from types import SimpleNamespace

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "is_torch_npu_available",
    "is_cuda_available",
    "is_npu_available",
    "get_device_name",
    "get_torch_device",
    "get_device_id",
    "get_nccl_backend",
    "get_visible_devices_keyword",
    "get_resource_name",
    "is_device_available",
    "get_device_capability",
    "set_expandable_segments",
    "auto_set_device",
    "resolve_trainer_device",
    "manual_seed",
    "manual_seed_all",
    "is_vllm_ascend_available",
]

_npu_probe_cache: dict[bool, bool] = {}


def is_torch_npu_available(check_device: bool = True) -> bool:
    """True when ``torch_npu`` is importable (and, with ``check_device``, an NPU is visible)."""
    if check_device in _npu_probe_cache:
        return _npu_probe_cache[check_device]
    available = False
    # find_spec first: importing a missing plugin is slow and noisy on CUDA/CPU hosts.
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)

            available = hasattr(torch, "npu") and (not check_device or bool(torch.npu.is_available()))
        except Exception as exc:  # a broken CANN install must not break CPU/CUDA users
            logger.debug("torch_npu present but unusable: %s", exc)
    _npu_probe_cache[check_device] = available
    return available


is_cuda_available: bool = torch.cuda.is_available()
is_npu_available: bool = is_torch_npu_available()


def get_device_name() -> str:
    """'cuda', 'npu' or 'cpu', in that order of preference."""
    if is_cuda_available:
        return "cuda"
    if is_npu_available:
        return "npu"
    return "cpu"


def _noop(*args, **kwargs):
    return None


def _zero(*args, **kwargs) -> int:
    return 0


# A stand-in for torch.cuda on CPU hosts: code calling empty_cache()/synchronize()/
# memory_allocated() etc. runs unchanged; anything else falls through to torch.cpu.
class _CpuDeviceModule(SimpleNamespace):
    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        raise AttributeError(
            f"the CPU device shim has no '{name}'; guard this call with get_device_name() != 'cpu'"
        )


_cpu_device_module = _CpuDeviceModule(
    is_available=lambda: False,
    device_count=_zero,
    current_device=_zero,
    set_device=_noop,
    synchronize=_noop,
    empty_cache=_noop,
    ipc_collect=_noop,
    reset_peak_memory_stats=_noop,
    memory_allocated=_zero,
    max_memory_allocated=_zero,
    memory_reserved=_zero,
    max_memory_reserved=_zero,
    manual_seed=lambda seed: torch.manual_seed(seed),
    manual_seed_all=lambda seed: torch.manual_seed(seed),
    get_rng_state=lambda *a, **k: torch.get_rng_state(),
    set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
    get_device_capability=lambda *a, **k: (None, None),
)


def get_torch_device():
    """The device module: ``torch.cuda``, ``torch.npu``, or a CPU shim with the same basic API."""
    name = get_device_name()
    if name == "cpu":
        return _cpu_device_module
    return getattr(torch, name)


def get_device_id() -> int:
    """Index of the current accelerator (0 on CPU, where it is only a placeholder)."""
    if get_device_name() == "cpu":
        return 0
    return get_torch_device().current_device()


def get_nccl_backend() -> str:
    """torch.distributed backend for device collectives: nccl (cuda), hccl (npu), gloo (cpu)."""
    name = get_device_name()
    if name == "cuda":
        return "nccl"
    if name == "npu":
        return "hccl"
    return "gloo"


def get_visible_devices_keyword() -> str:
    """Environment variable that restricts visible devices for this back end."""
    return "ASCEND_RT_VISIBLE_DEVICES" if get_device_name() == "npu" else "CUDA_VISIBLE_DEVICES"


def get_resource_name() -> str:
    """Ray resource name that accelerator actors should request ('GPU', 'NPU' or 'CPU')."""
    return {"cuda": "GPU", "npu": "NPU"}.get(get_device_name(), "CPU")


def is_device_available() -> bool:
    """True when an accelerator (not the CPU) is usable."""
    return get_device_name() != "cpu"


def get_device_capability(device_id: int = 0) -> tuple[int | None, int | None]:
    """(major, minor) compute capability on CUDA; (None, None) elsewhere."""
    if get_device_name() == "cuda":
        return torch.cuda.get_device_capability(device_id)
    return None, None


def set_expandable_segments(enable: bool) -> None:
    """Toggle the caching allocator's expandable segments (no-op on CPU)."""
    name = get_device_name()
    if name == "cuda":
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{enable}")
    elif name == "npu":
        os.environ["PYTORCH_NPU_ALLOC_CONF"] = f"expandable_segments:{enable}"


def resolve_trainer_device(requested: str) -> str:
    """The device this process will run on for ``trainer.device=requested``: always the detected one (an
    accelerator is never left idle, and a missing one cannot be conjured), with a warning naming the key
    when they differ, so a cuda config on a host without GPUs does not run on the CPU unannounced."""
    detected = get_device_name()
    if requested != detected:
        logger.warning("trainer.device=%s but this process sees %s; it runs on %s (set trainer.device=%s).",
                       requested, detected if detected != "cpu" else "no accelerator", detected, detected)
    return detected


def auto_set_device(config) -> None:
    """Rewrite ``config.trainer.device`` to the device this process runs on (see resolve_trainer_device)."""
    trainer = getattr(config, "trainer", None) if config is not None else None
    if trainer is None or not hasattr(trainer, "device"):
        return
    trainer.device = resolve_trainer_device(trainer.device)


def manual_seed(seed: int) -> None:
    """Seed the current accelerator's RNG (the CPU RNG on CPU)."""
    get_torch_device().manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    """Seed every accelerator's RNG (the CPU RNG on CPU)."""
    get_torch_device().manual_seed_all(seed)


def is_vllm_ascend_available() -> bool:
    """True on an NPU host with the vLLM-Ascend plugin installed: the vLLM engine then runs vLLM-Ascend's
    kernels and weight layouts (per-expert MoE names, post-processed expert layouts, NZ weight format)."""
    return get_device_name() == "npu" and importlib.util.find_spec("vllm_ascend") is not None


def cpu_threads_per_worker(workers_on_node: int) -> int:
    """Intra-op threads for each CPU worker process: ``VERL_CPU_THREADS`` if set; otherwise the host's cores split
    over the workers of this node, or 1 when the host is already busy (1-minute load average at or above its
    cores). OpenMP threads spin while they wait for each other, so on an oversubscribed box (several such
    processes per core) small-model steps ran tens of times slower; on a quiet 2-core host the one-worker demo
    steps in 0.39 s with 2 threads against 0.54 s with 1 (2026-11-27, docs/advance/performance.md)."""
    env = os.environ.get("VERL_CPU_THREADS")
    if env:
        return max(1, int(env))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - no load average on this platform
        load = 0.0
    if load >= cores:
        return 1
    return max(1, cores // max(1, workers_on_node))
