"""A CPU platform for verl's platform registry, so verl's FSDP engine runs on a machine without an accelerator
(tests and CPU-only Ray nodes). verl 0.9.1 registers only nvidia/huawei/amd and falls back to CUDA otherwise.

Uses verl's own extension points: `PlatformRegistry.register`, `VERL_PLATFORM` to select it, and
`VERL_ENGINE_DEVICE` so the engine registry hands out its FSDP language-model engine (registered for cuda/npu).
Collectives go through gloo. Never used where CUDA is available.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from typing import Any

import torch

PLATFORM_NAME = "cpu"


def _zero(*_: Any, **__: Any) -> int:
    return 0


# The subset of the torch.cuda module API verl's engine calls through `get_torch_device()` (memory statistics,
# seeding, synchronisation): all no-ops or zeros on CPU.
_DEVICE_MODULE = types.SimpleNamespace(
    current_device=lambda: "cpu", device_count=lambda: 1, set_device=lambda *_: None, synchronize=lambda *_: None,
    manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, empty_cache=lambda: None,
    max_memory_allocated=_zero, max_memory_reserved=_zero, memory_allocated=_zero, memory_reserved=_zero,
    reset_peak_memory_stats=lambda *_: None, is_available=lambda: True, mem_get_info=lambda *_: (0, 0),
    get_device_name=lambda *_: "CPU", current_stream=lambda *_: None,
)


def activate_if_no_accelerator() -> bool:
    """Register and select the CPU platform when torch sees no CUDA device; True when it did."""
    if torch.cuda.is_available():
        return False
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get(PLATFORM_NAME) is None:

        class CpuPlatform(PlatformBase):
            device_name = property(lambda self: "cpu")
            vendor_name = property(lambda self: "cpu")
            device_module = property(lambda self: _DEVICE_MODULE)

            def is_available(self) -> bool:
                return True

            def current_device(self) -> Any:
                return "cpu"  # used as `device_id` / `.to(device=...)` by the engine

            def device_count(self) -> int:
                return 1

            def set_device(self, device_index: int) -> None:
                return None

            def synchronize(self, device_index: int | None = None) -> None:
                return None

            def manual_seed(self, seed: int) -> None:
                torch.manual_seed(seed)

            def manual_seed_all(self, seed: int) -> None:
                torch.manual_seed(seed)

            def set_allocator_settings(self, settings: str) -> None:
                return None

            def empty_cache(self) -> None:
                return None

            def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
                return None, None

            def communication_backend_name(self) -> str:
                return "gloo"

            def visible_devices_envvar(self) -> str:
                return "CUDA_VISIBLE_DEVICES"

            @contextlib.contextmanager
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

            def is_ipc_supported(self) -> bool:
                return False

            def cudart(self) -> None:
                return None

        PlatformRegistry.register(PLATFORM_NAME)(CpuPlatform)
    os.environ["VERL_PLATFORM"] = PLATFORM_NAME
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # pick the engine class; tensors stay on the CPU platform's device
    return True
