"""Adapter paging (gateway/adapter_pager.py, docs/lineages.md "## Gateway"): capacity per instance, LRU eviction of
idle adapters only, single-flight on-demand loads, the page timeout; against a strict fake vLLM on a real socket that
refuses a load past its `max_loras`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.adapter_pager import AdapterPager
from openjiuwen.agent_evolving.agent_rl.gateway.holdings import Holdings
from openjiuwen.agent_evolving.agent_rl.gateway.instances import Instance
from openjiuwen.agent_evolving.agent_rl.gateway.lora_types import ActiveLora, LoraError
from openjiuwen.agent_evolving.agent_rl.gateway.vllm_adapters import AdapterClient, Load
from tests.support.fake_vllm import LOAD_PATH, UNLOAD_PATH, FakeVLLM

CAPACITY = 2


class Recorder:
    def __init__(self) -> None:
        self.loads: list[str] = []
        self.evictions: list[str] = []

    def adapter_loaded(self, instance: str, seconds: float, lora_name: str) -> None:
        self.loads.append(instance)

    def adapter_evicted(self, instance: str) -> None:
        self.evictions.append(instance)


@pytest.fixture
async def fake() -> AsyncIterator[FakeVLLM]:
    vllm = FakeVLLM(served_model="tiny", name="vllm-a", max_loras=CAPACITY)
    await vllm.astart()
    try:
        yield vllm
    finally:
        await vllm.astop()


@pytest.fixture
def versions(tmp_path: Path) -> dict[str, ActiveLora]:
    out = {}
    for lineage in ("a", "b", "c", "d"):
        directory = tmp_path / lineage / "v1"
        directory.mkdir(parents=True)
        out[lineage] = ActiveLora(f"tiny:{lineage}:v1", str(directory))
    return out


@pytest.fixture
async def pager(fake: FakeVLLM) -> AsyncIterator[tuple[AdapterPager, Holdings, Instance, Recorder]]:
    holdings, recorder = Holdings(), Recorder()
    paged = AdapterPager(AdapterClient(), holdings, capacity=lambda _: CAPACITY, page_timeout_s=0.5,
                         load_timeout_s=5.0, metrics=recorder)
    try:
        yield paged, holdings, Instance(fake.name, "tiny", fake.host, fake.port), recorder
    finally:
        await paged.aclose()


async def serve(paged: AdapterPager, instance: Instance, lora: ActiveLora) -> None:
    with paged.using(instance, lora.lora_name):
        await paged.ensure(instance, lora)


async def test_the_least_recently_used_idle_adapter_is_unloaded_first(pager, fake, versions) -> None:
    paged, holdings, instance, recorder = pager
    await serve(paged, instance, versions["a"])
    await serve(paged, instance, versions["b"])
    await serve(paged, instance, versions["a"])  # `a` used again: `b` is now the least recently used
    await serve(paged, instance, versions["c"])
    assert fake.loaded == {versions["a"].lora_name, versions["c"].lora_name}
    assert holdings.confirmed(instance.name) == fake.loaded
    assert paged.resident(instance.name) == [versions["a"].lora_name, versions["c"].lora_name]
    assert fake.peak_loaded == CAPACITY  # the strict fake refused nothing: the gateway kept within capacity
    assert (len(recorder.loads), len(recorder.evictions)) == (3, 1)


async def test_an_adapter_in_use_is_never_the_victim_and_the_wait_ends_in_503(pager, fake, versions) -> None:
    paged, _, instance, _ = pager
    with paged.using(instance, versions["a"].lora_name), paged.using(instance, versions["b"].lora_name):
        await paged.ensure(instance, versions["a"])
        await paged.ensure(instance, versions["b"])
        with pytest.raises(LoraError) as refused:
            await serve(paged, instance, versions["c"])
        assert refused.value.code == "lora_capacity_exhausted"
        assert fake.loaded == {versions["a"].lora_name, versions["b"].lora_name}


async def test_a_waiting_load_takes_the_slot_a_finished_request_frees(pager, fake, versions) -> None:
    paged, _, instance, _ = pager
    use_a = contextlib.ExitStack()
    use_a.enter_context(paged.using(instance, versions["a"].lora_name))
    await paged.ensure(instance, versions["a"])
    with paged.using(instance, versions["b"].lora_name):
        await paged.ensure(instance, versions["b"])
        waiting = asyncio.create_task(serve(paged, instance, versions["c"]))
        for _ in range(20):  # let it run until it waits for a slot (no slot can free while both are used)
            await asyncio.sleep(0)
        assert not waiting.done() and fake.loaded == {versions["a"].lora_name, versions["b"].lora_name}
        use_a.close()  # `a`'s request ends: it becomes the victim
        await waiting
    assert fake.loaded == {versions["b"].lora_name, versions["c"].lora_name}


async def test_concurrent_requests_for_one_version_share_one_load(pager, fake, versions) -> None:
    paged, _, instance, _ = pager
    fake.delay_next(LOAD_PATH, 0.2)
    await asyncio.gather(*(serve(paged, instance, versions["a"]) for _ in range(5)))
    assert fake.count(LOAD_PATH) == 1


async def test_a_version_that_cannot_load_is_502_and_frees_its_slot(pager, fake, versions, tmp_path) -> None:
    paged, holdings, instance, _ = pager
    missing = ActiveLora("tiny:a:v2", str(tmp_path / "gone"))
    with pytest.raises(LoraError) as failed:
        await serve(paged, instance, missing)
    assert failed.value.code == "lora_load_failed"
    assert paged.resident(instance.name) == []
    assert not holdings.holds(instance.name, missing.lora_name)


async def test_capacity_zero_is_unlimited(fake, versions) -> None:
    fake.max_loras = None
    paged = AdapterPager(AdapterClient(), Holdings(), capacity=lambda _: 0, page_timeout_s=0.5, load_timeout_s=5.0)
    instance = Instance(fake.name, "tiny", fake.host, fake.port)
    try:
        deadline = asyncio.get_running_loop().time() + 5
        outcomes = [await paged.load(instance, lora, deadline) for lora in versions.values()]
        assert [o for o, _ in outcomes] == [Load.NEW] * 4
        assert len(fake.loaded) == 4 and paged.resident(instance.name) == []
    finally:
        await paged.aclose()


async def test_a_version_requested_while_it_is_paged_out_reserves_a_slot_again(pager, fake, versions) -> None:
    """The victim's unload is in flight when a request wants it back: the load waits and takes a slot of its own
    (before the fix it was sent at once, against a slot count that no longer held it)."""
    paged, holdings, instance, _ = pager
    await serve(paged, instance, versions["a"])
    await serve(paged, instance, versions["b"])
    fake.delay_next(UNLOAD_PATH, 0.2)  # `a`'s unload, to make room for `c`, lands late
    for_c = asyncio.create_task(serve(paged, instance, versions["c"]))
    while fake.count(UNLOAD_PATH) == 0:
        await asyncio.sleep(0.01)  # until the unload is on its way (synchronisation, not a timing assert)
    await asyncio.gather(for_c, serve(paged, instance, versions["a"]))
    assert fake.loaded == {versions["c"].lora_name, versions["a"].lora_name}
    assert holdings.confirmed(instance.name) == fake.loaded
    assert fake.peak_loaded == CAPACITY
