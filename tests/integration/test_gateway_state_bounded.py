"""What the gateway keeps in memory per version and per instance is pruned (issue 37 item 8): 10,000 distinct
versions pass through routing, paging and release, and 100 registered instances come and go, and the LoRA manager
holds no more than after the first 1,000 versions. In process: the strict fake vLLM's routes reached through
`httpx.ASGITransport` (the same recorded shapes, no socket), so the 10,000 versions take seconds."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import httpx
import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.instances.instance_addresses import AddressPolicy
from openjiuwen.agent_evolving.agent_rl.gateway.instances.instances import Instance, InstanceRegistry
from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_manager import LoraManager
from tests.support.fake_vllm import FakeVLLM

CAPACITY = 4
GATEWAY_PACKAGE = "openjiuwen.agent_evolving.agent_rl.gateway."


def entries(root: object) -> int:
    """Every entry of every dict, set, list and deque reachable from `root` through the gateway's own objects: what
    grows when a map keeps something per version or per instance and never lets go."""
    seen: set[int] = set()
    total = 0
    stack: list[Any] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (dict, collections.OrderedDict)):
            total += len(obj)
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (set, frozenset, list, tuple, collections.deque)):
            total += len(obj)
            stack.extend(obj)
        elif type(obj).__module__.startswith(GATEWAY_PACKAGE) and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
        elif type(obj).__module__.startswith(GATEWAY_PACKAGE) and hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, name) for name in obj.__slots__ if hasattr(obj, name))
    return total


@pytest.fixture
async def loras(tmp_path: Path) -> AsyncIterator[LoraManager]:
    fake = FakeVLLM(served_model="tiny", name="vllm-a")
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=fake.app()))
    manager = LoraManager(
        InstanceRegistry([Instance("vllm-a", "tiny", "127.0.0.1", 9)], max_registered=200),
        lora_root=tmp_path, state_path=tmp_path / "state.json", operation_timeout_s=5.0,
        addresses=AddressPolicy(allowed_networks=[ip_network("127.0.0.0/8")]), client=client,
        max_loras_default=CAPACITY, page_timeout_s=5.0)
    await manager.restore()
    try:
        yield manager
    finally:
        await manager.close()
        await client.aclose()


def adapter_dir(tmp_path: Path) -> str:
    """One adapter directory every version loads from (the fake checks the path is a directory, nothing more)."""
    path = tmp_path / "adapter"
    path.mkdir(exist_ok=True)
    return str(path)


async def serve_versions(loras: LoraManager, tmp_path: Path, numbers: range) -> None:
    """Each version as an old version pinned by a Task: known to the manager (its path, as its activation left
    it), leased, paged in by one request (every tenth outside a Task), and released when the Task ends."""
    for n in numbers:
        name = f"tiny:u{n % 97}:v{n // 97 + 1}"
        loras._placement.paths[name] = adapter_dir(tmp_path)  # what its activation recorded (10,000 of them
        loras.acquire(name)                                    # would spend minutes writing the state file)
        instance = loras.routing.pick("tiny", name, captured=True)
        with contextlib.ExitStack() as counts:
            counts.enter_context(loras.routing.in_flight(instance))
            await loras.page_in(instance, name, counts, task=n % 10 != 0)
        await loras.release(name)


async def churn_instances(loras: LoraManager, tmp_path: Path, numbers: range) -> None:
    """Registered instances that each page a version in, then an operator removes."""
    for n in numbers:
        assert await loras.register_instance(f"r{n}", "tiny", "127.0.0.1", 9000 + n, max_loras=2) is True
        name = f"tiny:r:v{n + 1}"
        loras._placement.paths[name] = adapter_dir(tmp_path)
        instance = next(i for i in loras._registry.serving("tiny") if i.name == f"r{n}")
        with contextlib.ExitStack() as counts:
            counts.enter_context(loras.routing.in_flight(instance))
            await loras.page_in(instance, name, counts)
        loras.remove_instance(f"r{n}")
        loras._placement.paths.pop(name)


async def test_ten_thousand_versions_and_a_hundred_instances_leave_nothing_behind(loras, tmp_path) -> None:
    await serve_versions(loras, tmp_path, range(1000))
    await churn_instances(loras, tmp_path, range(10))
    after_first = entries(loras)

    await serve_versions(loras, tmp_path, range(1000, 10_000))
    await churn_instances(loras, tmp_path, range(10, 100))

    assert entries(loras) <= after_first, "per-version or per-instance state kept after it was released"
    assert len(loras.pager.resident("vllm-a")) <= CAPACITY
