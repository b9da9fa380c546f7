"""The CPU shims that let verl's own distributed trainer run on CPU over gloo (CI and machines without GPUs).

verl 0.9 ships platforms for NVIDIA, Huawei and AMD only, and registers its FSDP engines for ``cuda``/``npu``.
Three small shims, all through verl's public extension points (no patched verl code), make the same code
path that runs on GPUs run on a local Ray cluster of CPU workers:

1. ``PlatformCPU``, registered as ``cpu`` with ``verl.plugin.platform.PlatformRegistry``: device ``cpu``,
   collective backend ``gloo``, Ray resource ``CPU``. Loaded in every process by ``VERL_PLATFORM=cpu`` and
   ``VERL_USE_EXTERNAL_MODULES=steptap.learner.engines.verl_cpu`` (verl imports that module when it is
   imported itself, see ``verl/__init__.py``); ``worker_env()`` gives both to the Ray workers.
2. ``register_fsdp2_for_cpu()``: verl's FSDP engine class registered for device ``cpu`` under ``fsdp2`` only
   (FSDP1 cannot train on CPU: verl forces ``sync_module_states=True``, which torch refuses for CPU tensors).
3. ``init_gloo()``: called by the worker before verl's ``TrainingWorker.__init__``; otherwise verl builds
   the backend string ``cpu:gloo,cpu:gloo`` from the device name, which torch rejects.

Beside them, ``attention()``: the attention verl's model uses on each platform (flash-attention over packed
rows only where ``flash_attn`` is installed; SDPA on padded rows on CPU and on GPUs without it).

``tests/unit/test_verl_cpu.py`` checks each against the installed verl, so a verl release that moves these
extension points fails that test instead of a training run.
"""

from __future__ import annotations

import importlib.util
import os
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

MODULE = __name__
PLATFORM = "cpu"


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the CUDA-style calls verl makes on its device module (memory statistics, RNG,
    cache). Memory figures are 0 (the CPU has no device allocator to ask); RNG goes to torch's CPU
    generator."""

    def __init__(self) -> None:
        super().__init__("steptap_cpu_device")

    def __getattr__(self, name: str) -> Any:  # everything torch.cpu has (Stream, current_stream, ...)
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"  # verl builds devices from this: an int would make it move tensors to cuda:N

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def mem_get_info(*_: Any) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def get_rng_state(*_: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *_: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def _zero(*_: Any, **__: Any) -> int:
        return 0

    memory_allocated = memory_reserved = max_memory_allocated = max_memory_reserved = _zero

    @staticmethod
    def reset_peak_memory_stats(*_: Any) -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(*_: Any) -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def get_device_name(*_: Any) -> str:
        return "cpu"


DEVICE_MODULE = _CPUDeviceModule()


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """verl's platform interface answered for the CPU."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: only VERL_PLATFORM=cpu selects it, so GPU machines are unaffected

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: Any) -> None:
        return None

    def synchronize(self, device_index: Any = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "STEPTAP_CPU_VISIBLE_DEVICES"  # nothing reads it; verl only needs a name

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {}  # the worker's num_cpus comes from the resource pool's bundle

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def register_fsdp2_for_cpu() -> None:
    """Register verl's FSDP2 language-model engine for device ``cpu`` (idempotent)."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    registry = EngineRegistry._engines["language_model"]["fsdp2"]  # verl's documented registry table
    if registry.get(PLATFORM) is not FSDPEngineWithLMHead:
        registry.pop(PLATFORM, None)
        EngineRegistry.register(model_type="language_model", backend="fsdp2",
                                device=PLATFORM)(FSDPEngineWithLMHead)


def init_gloo() -> None:
    """Join the worker group's process group over gloo, from the env Ray's worker group sets (RANK, ...)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))


def worker_env() -> dict[str, str]:
    """What every process of a CPU run needs before it imports verl (Ray workers get it via runtime_env)."""
    return {"VERL_PLATFORM": PLATFORM, "VERL_USE_EXTERNAL_MODULES": MODULE}


def activate() -> None:
    """Select the CPU platform in this process (the driver) and register the engine; call before verl's
    platform singleton is first read."""
    os.environ.update(worker_env())
    from verl.plugin.platform import platform_manager

    if platform_manager._current_platform is None or platform_manager._current_platform.device_name != "cpu":
        platform_manager.set_platform(PlatformCPU())
    register_fsdp2_for_cpu()


def attention(cpu: bool) -> tuple[bool, str]:
    """(use_remove_padding, attn_implementation) for verl's model. verl defaults to flash_attention_2 over
    packed rows, which needs the ``flash_attn`` package (CUDA only, often absent: it is built per torch and
    CUDA version). Without it, torch's sdpa over padded rows: sdpa on packed rows would attend across
    sequences."""
    flash = not cpu and importlib.util.find_spec("flash_attn") is not None
    return flash, "flash_attention_2" if flash else "sdpa"
