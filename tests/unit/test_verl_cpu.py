"""The CPU shims against the installed verl: each fails here, not in a training run, when verl moves the
extension point it relies on (the platform registry and its abstract interface, the engine registry's table,
the device-module calls verl makes, the process-group backend string, the version range)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from steptap.learner.engines import verl_cpu


def test_the_cpu_platform_is_registered_and_implements_every_abstract_method() -> None:
    assert PlatformRegistry.get("cpu") is verl_cpu.PlatformCPU
    platform = verl_cpu.PlatformCPU()  # raises TypeError if verl added an abstract method we lack
    assert platform.device_name == "cpu" and platform.communication_backend_name() == "gloo"
    assert platform.ray_resource_name() == "CPU" and platform.ray_resource_options(1) == {}
    assert platform.current_device() == "cpu"  # an int would send tensors to cuda:N
    assert not platform.is_platform_available(use_smi_check=True)  # never auto-detected on a GPU machine
    assert set(PlatformBase.__abstractmethods__) <= set(vars(verl_cpu.PlatformCPU))


def _device_module_calls() -> set[str]:
    """Every ``get_torch_device().NAME`` verl's source calls."""
    import verl

    names: set[str] = set()
    for path in Path(verl.__file__).parent.rglob("*.py"):
        names |= set(re.findall(r"get_torch_device\(\)\.([A-Za-z_]+)", path.read_text(errors="replace")))
    return names


def test_the_device_module_answers_every_call_verl_makes() -> None:
    missing = sorted(n for n in _device_module_calls() if not hasattr(verl_cpu.DEVICE_MODULE, n))
    assert not missing, f"verl calls get_torch_device().{missing} which the CPU device module lacks"
    dm = verl_cpu.DEVICE_MODULE
    assert dm.max_memory_allocated() == 0 and dm.current_device() == "cpu"
    state = dm.get_rng_state()
    a = torch.rand(3)
    dm.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))  # RNG goes to torch's CPU generator


def test_fsdp2_is_registered_for_cpu_and_only_fsdp2() -> None:
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    verl_cpu.register_fsdp2_for_cpu()
    verl_cpu.register_fsdp2_for_cpu()  # idempotent
    table = EngineRegistry._engines["language_model"]
    assert table["fsdp2"]["cpu"] is FSDPEngineWithLMHead
    assert "cpu" not in table["fsdp"]  # FSDP1 cannot train on CPU (sync_module_states)


def test_verl_still_builds_the_backend_string_that_init_gloo_avoids() -> None:
    """If verl stops building ``cpu:gloo,<device>:<backend>`` the gloo shim may be unneeded: revisit it."""
    from verl.utils import distributed

    src = inspect.getsource(distributed.initialize_global_process_group_ray)
    assert 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' in src
    assert "if not torch.distributed.is_initialized()" in src  # and it skips a group we already made


def test_worker_env_loads_this_module_in_verl_workers() -> None:
    import verl

    env = verl_cpu.worker_env()
    assert env == {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "steptap.learner.engines.verl_cpu"}
    tree = ast.parse(Path(verl.__file__).read_text())
    read = {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
            and isinstance(n.args[0], ast.Constant) and getattr(n.func, "attr", "") == "getenv"}
    assert "VERL_USE_EXTERNAL_MODULES" in read  # verl imports the module named there at import time


def test_verl_version_is_checked() -> None:
    from steptap.learner.engines.verl_engine import check_verl_version

    assert check_verl_version() == "0.9.1"
    with pytest.MonkeyPatch.context() as mp:
        import importlib.metadata

        mp.setattr(importlib.metadata, "version", lambda name: "0.10.2")
        with pytest.raises(RuntimeError, match=r"written against verl .*found verl 0.10.2"):
            check_verl_version()


def test_attention_is_flash_over_packed_rows_only_where_flash_attn_is_installed(monkeypatch) -> None:
    import importlib.util

    from verl.workers.config import HFModelConfig

    # verl's own default, which the GPU path replaces when flash_attn is missing (it is, on these machines)
    assert '"attn_implementation", "flash_attention_2"' in inspect.getsource(HFModelConfig)
    assert verl_cpu.attention(cpu=True) == (False, "sdpa")
    have = importlib.util.find_spec("flash_attn") is not None
    assert verl_cpu.attention(cpu=False) == ((True, "flash_attention_2") if have else (False, "sdpa"))
    real = importlib.util.find_spec  # a stand-in for an installed flash_attn (none can be installed here)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: object() if n == "flash_attn" else real(n, *a))
    assert verl_cpu.attention(cpu=False) == (True, "flash_attention_2")
    assert verl_cpu.attention(cpu=True) == (False, "sdpa")  # never flash on CPU
