"""Instance health (issue 19, item 4) against fake vLLM instances on real sockets: the failure threshold, readmission
with the adapters first, and activations when instances are out of routing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.instances import health
from openjiuwen.agent_evolving.agent_rl.gateway.instances.health import HEALTH_PATH, HealthMonitor
from openjiuwen.agent_evolving.agent_rl.gateway.instances.instance_addresses import AddressPolicy
from openjiuwen.agent_evolving.agent_rl.gateway.instances.instances import Instance, InstanceRegistry
from tests.support.gateway_errors import http_status
from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_manager import LoraError, LoraManager
from tests.support.fake_vllm import FakeVLLM

MODEL = "tiny"


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeVLLM]]:
    instances = [FakeVLLM(served_model=MODEL, name=f"vllm-{c}") for c in "ab"]
    await asyncio.gather(*(f.astart() for f in instances))
    try:
        yield instances
    finally:
        await asyncio.gather(*(f.astop() for f in instances))


@pytest.fixture
def lora_root(tmp_path: Path) -> Path:
    root = tmp_path / "loras"
    for n in (1, 2):
        (root / MODEL / f"v{n}").mkdir(parents=True)
    return root


async def test_threshold_then_readmission_with_the_active_adapter_before_routing(
    fakes: list[FakeVLLM], lora_root: Path, tmp_path: Path
) -> None:
    a, b = fakes
    registry = InstanceRegistry([Instance(f.name, MODEL, f.host, f.port) for f in fakes])
    loras = LoraManager(registry, lora_root=lora_root, state_path=tmp_path / "state.json", operation_timeout_s=3.0,
                        addresses=AddressPolicy())
    seen_serving: list[bool] = []

    async def readmit(instance: Instance) -> None:
        seen_serving.append(registry.is_serving(instance.name))  # still out while the adapters load
        await loras.readmit(instance)

    monitor = HealthMonitor(registry, readmit=readmit, interval_s=1.0, timeout_s=1.0, failure_threshold=2)
    try:
        await loras.restore()
        await loras.activate(base_model="/m", lora_name=f"{MODEL}:v1", lora_path=str(lora_root / MODEL / "v1"),
                             expected_lora_name="base")
        b.fail_next(HEALTH_PATH, 503, times=3)
        await monitor.check_once()
        assert registry.is_serving("vllm-b")  # one failure is below the threshold
        await monitor.check_once()
        assert not registry.is_serving("vllm-b")
        assert [i.name for i in registry.serving(MODEL)] == ["vllm-a"]
        assert all(loras.routing.pick(MODEL, MODEL).name == "vllm-a" for _ in range(4))

        # Out of the quorum: the next version activates on a alone, and b neither blocks nor counts.
        await loras.activate(base_model="/m", lora_name=f"{MODEL}:v2", lora_path=str(lora_root / MODEL / "v2"),
                             expected_lora_name=f"{MODEL}:v1")
        assert loras.status(MODEL)["status"] == "active"
        assert loras.status(MODEL)["instances"] == {"ready": 1, "failed": 0}
        assert b.loaded == {f"{MODEL}:v1"}

        await monitor.check_once()  # the third scripted failure: still out, nothing readmitted
        assert seen_serving == [] and not registry.is_serving("vllm-b")
        b.drop_loras()  # it restarted
        await monitor.check_once()
        assert seen_serving == [False]
        assert registry.is_serving("vllm-b") and b.loaded == {f"{MODEL}:v2"}  # v1: neither active nor leased
        assert loras.status(MODEL)["instances"] == {"ready": 2, "failed": 0}
    finally:
        await loras.close()
        await monitor.close()


async def test_activation_with_every_instance_out_of_routing_fails_clearly(
    fakes: list[FakeVLLM], lora_root: Path, tmp_path: Path
) -> None:
    registry = InstanceRegistry([Instance(f.name, MODEL, f.host, f.port) for f in fakes])
    loras = LoraManager(registry, lora_root=lora_root, state_path=tmp_path / "state.json", operation_timeout_s=3.0,
                        addresses=AddressPolicy())
    try:
        await loras.restore()
        for instance in registry.all():
            registry.set_serving(instance, False)
        with pytest.raises(LoraError) as refused:
            await loras.activate(base_model="/m", lora_name=f"{MODEL}:v1",
                                 lora_path=str(lora_root / MODEL / "v1"), expected_lora_name="base")
        assert (http_status(refused.value), refused.value.code) == (503, "no_healthy_instances")
        assert loras.status(MODEL)["status"] == "base" and not (tmp_path / "state.json").exists()
        with pytest.raises(LoraError) as no_route:
            loras.routing.pick(MODEL, MODEL)
        assert (http_status(no_route.value), no_route.value.code) == (503, "no_healthy_instances")
        assert all(f.loaded == set() for f in fakes)
    finally:
        await loras.close()


async def test_urgent_rechecks_are_single_flight_spaced_and_bounded(fakes: list[FakeVLLM]) -> None:
    """Issue 28 item 12: a request finding no healthy instance asks for a check now. Many such requests at once
    probe each instance once; one right after a check reuses its result; a slow check bounds the request's wait but
    goes on for the others."""
    a, b = fakes
    registry = InstanceRegistry([Instance(f.name, MODEL, f.host, f.port) for f in fakes])
    readmitted: list[str] = []

    async def readmit(instance: Instance) -> None:
        readmitted.append(instance.name)
        registry.set_serving(instance, True)

    monitor = HealthMonitor(registry, readmit=readmit, interval_s=60.0, timeout_s=1.0, failure_threshold=3)
    try:
        for f in fakes:
            f.fail_next(HEALTH_PATH, 503)
        await monitor.check_once(at_start=True)
        assert registry.serving(MODEL) == []
        probes = [f.count(HEALTH_PATH) for f in fakes]

        await asyncio.gather(*(monitor.recheck() for _ in range(20)))
        assert [f.count(HEALTH_PATH) - n for f, n in zip(fakes, probes)] == [1, 1]  # one shared check
        assert sorted(readmitted) == ["vllm-a", "vllm-b"]

        registry.set_serving(registry.get("vllm-a"), False)
        await monitor.recheck()  # the last check just ended: its result stands, nothing is probed
        assert [f.count(HEALTH_PATH) - n for f, n in zip(fakes, probes)] == [1, 1]

        await asyncio.sleep(health.RECHECK_MIN_GAP_S)
        a.delay_next(HEALTH_PATH, 3.0)  # longer than the request may wait (one probe timeout)
        monitor.recheck_wait_s = 0.2
        await monitor.recheck()
        assert not registry.is_serving("vllm-a")  # the request went on without it ...
        await monitor.recheck()  # ... a second one joins the same check rather than starting another
        assert a.count(HEALTH_PATH) - probes[0] == 2
    finally:
        await monitor.close()
