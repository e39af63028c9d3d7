"""What a registration may name and what a registered instance may block (issue 28, item 1), against fake vLLM
instances on real sockets. DNS answers come from a scripted resolver: the one thing here that cannot run for real."""

from __future__ import annotations

from collections.abc import AsyncIterator
from ipaddress import ip_network
from pathlib import Path

import pytest

from tests.support.gateway_errors import http_status
from openjiuwen.agent_evolving.agent_rl.gateway.instances.instance_addresses import AddressPolicy
from openjiuwen.agent_evolving.agent_rl.gateway.instances.instances import Instance, InstanceRegistry
from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_manager import LoraError, LoraManager
from tests.integration.test_gateway_lora_manager import (  # noqa: F401  (fixtures)
    MODEL, V1, V2, activate, artifact, fakes, lora_root, state_path,
)
from tests.support.fake_vllm import LOAD_PATH, FakeVLLM


class ScriptedDNS:
    """name → the addresses a lookup answers now; an unknown name fails like the OS resolver does."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str]] = {}
        self.lookups: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        if host not in self.answers:
            raise OSError(-2, "Name or service not known")
        return list(self.answers[host])


@pytest.fixture
def dns() -> ScriptedDNS:
    return ScriptedDNS()


@pytest.fixture
async def manager(fakes: list[FakeVLLM], lora_root: Path, state_path: Path,
                  dns: ScriptedDNS) -> AsyncIterator[LoraManager]:
    registry = InstanceRegistry([Instance(f.name, f.served_model, f.host, f.port) for f in fakes])
    addresses = AddressPolicy(allowed_networks=[ip_network("127.0.0.1/32")], resolver=dns)
    loras = LoraManager(registry, lora_root=lora_root, state_path=state_path, operation_timeout_s=3.0,
                        addresses=addresses)
    await loras.restore()
    try:
        yield loras
    finally:
        await loras.close()


async def refused(loras: LoraManager, name: str, host: str, port: int) -> str:
    with pytest.raises(LoraError) as refusal:
        await loras.register_instance(name, MODEL, host, port)
    assert (http_status(refusal.value), refusal.value.code) == (400, "instance_address_refused")
    return refusal.value.message


async def test_a_name_is_resolved_once_and_the_instance_kept_at_the_address_checked(
    manager: LoraManager, lora_root: Path, dns: ScriptedDNS
) -> None:
    await activate(manager, lora_root, 1, "base")
    async with FakeVLLM(served_model=MODEL, name="vllm-d") as d:
        dns.answers["vllm-d.internal"] = ["127.0.0.1"]
        assert await manager.register_instance("vllm-d", MODEL, "vllm-d.internal", d.port) is True
        assert d.loaded == {V1}
        row = next(i for i in manager.instances() if i["name"] == "vllm-d")
        assert row["address"] == f"127.0.0.1:{d.port}"

        # The name now points at a metadata service (DNS rebinding): nothing follows it.
        dns.answers["vllm-d.internal"] = ["169.254.169.254"]
        assert "link-local" in await refused(manager, "vllm-d", "vllm-d.internal", d.port)
        assert await refused(manager, "vllm-e", "vllm-d.internal", d.port)
        held = [i for i in (manager.routing.pick(MODEL, V1) for _ in range(12)) if i.name == "vllm-d"]
        assert held and {i.base_url for i in held} == {f"http://127.0.0.1:{d.port}"}
        assert len(dns.lookups) == 3  # the two refused registrations; routing never resolves the name again

    # One internal address among others is enough to refuse; a name that does not resolve is refused too.
    dns.answers["mixed.internal"] = ["198.51.100.7", "127.0.0.2"]
    assert "loopback" in await refused(manager, "mixed", "mixed.internal", 8000)
    assert "does not resolve" in await refused(manager, "ghost", "ghost.internal", 8000)
    assert {i["name"] for i in manager.instances()} == {"vllm-a", "vllm-b", "vllm-c", "vllm-d"}


async def test_a_registered_instance_that_fails_a_canary_start_is_left_out_of_the_candidate(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    async with FakeVLLM(served_model=MODEL, name="vllm-d") as d:
        await manager.register_instance(d.name, MODEL, d.host, d.port)
        assert d.loaded == {V1}
        d.fail_loads = True

        answer = await manager.start_canary(base_model="/m", lora_name=V2, lora_path=artifact(lora_root, 2),
                                            expected_lora_name=V1, share=0.5)

        assert answer["candidate"]["lora_name"] == V2 and answer["candidate"]["instances"] == {"ready": 3}
        assert all(f.loaded == {V1, V2} for f in fakes) and d.loaded == {V1}
        assert "vllm-d" not in {manager.routing.pick(MODEL, V2).name for _ in range(12)}
        assert manager.status(MODEL)["status"] == "active"  # the active version is whole everywhere

        d.fail_loads = False
        await manager.retry_failed()  # the periodic repair loads the candidate where it is missing
        assert d.loaded == {V1, V2} and manager.canary_status(MODEL)["candidate"]["instances"] == {"ready": 4}


async def test_when_no_instance_could_load_it_the_switch_still_fails(
    lora_root: Path, state_path: Path, dns: ScriptedDNS
) -> None:
    """Registered instances only: a version that no instance holds would strand every Task pinned to it."""
    addresses = AddressPolicy(allowed_networks=[ip_network("127.0.0.1/32")], resolver=dns)
    loras = LoraManager(InstanceRegistry(), lora_root=lora_root, state_path=state_path, operation_timeout_s=3.0,
                        addresses=addresses)
    try:
        async with FakeVLLM(served_model=MODEL, name="vllm-r") as r:
            await loras.register_instance(r.name, MODEL, r.host, r.port)
            r.fail_loads = True
            with pytest.raises(LoraError) as failed:
                await activate(loras, lora_root, 1, "base")
            assert (http_status(failed.value), failed.value.code) == (502, "lora_activation_failed")
            assert loras.snapshot(MODEL) == ("base", MODEL) and r.count(LOAD_PATH) == 1
    finally:
        await loras.close()
