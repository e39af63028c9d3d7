"""Adapter paging (gateway/lora/adapter_pager.py, docs/lineages.md "## Gateway"): capacity per instance, LRU eviction of
idle adapters only, single-flight on-demand loads, the page timeout; against a strict fake vLLM on a real socket that
refuses a load past its `max_loras`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.instances.instances import Instance, InstanceRegistry
from openjiuwen.agent_evolving.agent_rl.gateway.lora.adapter_pager import AdapterPager
from openjiuwen.agent_evolving.agent_rl.gateway.lora.holdings import Holdings
from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_manager import LoraManager
from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_types import ActiveLora, LoraError
from openjiuwen.agent_evolving.agent_rl.gateway.lora.vllm_adapters import AdapterClient, Load
from tests.integration.test_gateway_lora_manager import LOOPBACK_ALLOWED
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


async def test_concurrent_loads_of_one_version_keep_it_no_victim_until_the_last_answers(pager, fake, versions) -> None:
    """Two loads of `b` in flight, the first answers: `b` is still loading, so a page-in for `c` must not evict it (a
    set of loading marks let the first answer clear the second's mark, and `b` was unloaded under the later load)."""
    paged, _, instance, _ = pager
    deadline = asyncio.get_running_loop().time() + 5
    with paged.using(instance, versions["a"].lora_name):
        await paged.ensure(instance, versions["a"])
        fake.delay_next(LOAD_PATH, 0.3)  # the first load of `b` answers late
        slow = asyncio.create_task(paged.load(instance, versions["b"], deadline))
        while fake.count(LOAD_PATH) < 2:
            await asyncio.sleep(0.01)  # until the slow load is at the fake (synchronisation only)
        assert (await paged.load(instance, versions["b"], deadline))[0].held  # the second load answers first
        for_c = asyncio.create_task(serve(paged, instance, versions["c"]))
        while not slow.done():  # the wake that ends the slow load is the first moment `b` may go
            assert fake.count(UNLOAD_PATH) == 0, "`b` was evicted while a load of it was in flight"
            await asyncio.sleep(0.01)
        await slow
        await for_c  # once `b`'s last load answered it is idle: it makes room for `c`
    assert fake.loaded == {versions["a"].lora_name, versions["c"].lora_name}


class PausedListing(AdapterClient):
    """The real client; a listing's answer is held back until `release`, as a slow network would."""

    def __init__(self) -> None:
        super().__init__()
        self.answered = asyncio.Event()
        self.release = asyncio.Event()

    async def held(self, instance: Instance, deadline: float) -> set[str] | None:
        held = await super().held(instance, deadline)
        self.answered.set()
        await self.release.wait()
        return held


async def test_a_listing_is_not_applied_to_names_changed_since_it_was_requested(fake, versions) -> None:
    client = PausedListing()
    paged = AdapterPager(client, Holdings(), capacity=lambda _: CAPACITY, page_timeout_s=0.5, load_timeout_s=5.0)
    instance = Instance(fake.name, "tiny", fake.host, fake.port)
    try:
        await serve(paged, instance, versions["a"])
        await serve(paged, instance, versions["b"])
        listing = asyncio.create_task(paged.held(instance, asyncio.get_running_loop().time() + 5))
        await client.answered.wait()  # the instance listed {a, b}; the answer is on its way
        await serve(paged, instance, versions["c"])  # evicts `a`, loads `c`
        client.release.set()
        # The instance listed {a, b}; what it holds now is {b, c}: holdings (sync_loaded) must not confirm `a` there.
        assert await listing == {versions["b"].lora_name, versions["c"].lora_name}
        # Before the fix the stale listing brought back `a` and dropped `c`: slots counted what was not there.
        assert set(paged.resident(instance.name)) == fake.loaded == {versions["b"].lora_name, versions["c"].lora_name}
    finally:
        await paged.aclose()


async def test_unload_skips_a_version_in_use_and_the_lru_unloads_it_once_idle(pager, fake, versions) -> None:
    paged, _, instance, _ = pager
    deadline = asyncio.get_running_loop().time() + 5
    with paged.using(instance, versions["a"].lora_name):
        await paged.ensure(instance, versions["a"])
        assert await paged.unload(instance, versions["a"].lora_name, deadline) is False  # a request is in flight
        assert fake.count(UNLOAD_PATH) == 0 and versions["a"].lora_name in fake.loaded
    await serve(paged, instance, versions["b"])
    await serve(paged, instance, versions["c"])  # `a` is idle now and least recently used: paged out
    assert fake.loaded == {versions["b"].lora_name, versions["c"].lora_name}
    assert await paged.unload(instance, versions["b"].lora_name, deadline) is True  # idle: unloaded at once
    assert fake.loaded == {versions["c"].lora_name} and paged.resident(instance.name) == [versions["c"].lora_name]


# ---------------------------------------------------------------------------------------------- policy switches


@pytest.fixture
def lora_root(tmp_path: Path) -> Path:
    return tmp_path / "loras"


def version_dir(root: Path, lineage: str) -> ActiveLora:
    directory = root / lineage / "v1"
    directory.mkdir(parents=True, exist_ok=True)
    return ActiveLora(f"tiny:{lineage}:v1", str(directory))


def paging_manager(fake: FakeVLLM, root: Path, tmp_path: Path, *, page_timeout_s: float) -> LoraManager:
    registry = InstanceRegistry([Instance(fake.name, "tiny", fake.host, fake.port)])
    return LoraManager(registry, lora_root=root, state_path=tmp_path / "state.json", operation_timeout_s=3.0,
                       addresses=LOOPBACK_ALLOWED, max_loras_default=CAPACITY, page_timeout_s=page_timeout_s)


async def activate(loras: LoraManager, lora: ActiveLora) -> dict:
    return await loras.activate(base_model="/models/tiny", lora_name=lora.lora_name, lora_path=lora.lora_path,
                                expected_lora_name="base")


async def test_a_switch_keeps_its_version_pinned_until_holdings_record_it(fake, lora_root, tmp_path,
                                                                          monkeypatch) -> None:
    """Another line pages in while an activation writes the state file: before the fix it evicted the just-loaded
    version and the switch then confirmed it where vLLM no longer held it (requests 404 forever)."""
    loras = paging_manager(fake, lora_root, tmp_path, page_timeout_s=5.0)
    a, b, c = (version_dir(lora_root, x) for x in "abc")
    instance = Instance(fake.name, "tiny", fake.host, fake.port)
    await loras.restore()
    try:
        await activate(loras, a)
        state_file = loras._state_file
        write, writing, release = state_file.write, asyncio.Event(), asyncio.Event()

        async def slow_write(*args, **kwargs):
            writing.set()
            await release.wait()
            return await write(*args, **kwargs)

        monkeypatch.setattr(state_file, "write", slow_write)
        with loras.pager.using(instance, a.lora_name):  # `a` busy: `b` is the only possible victim
            switching = asyncio.create_task(activate(loras, b))
            await writing.wait()  # `b` is loaded; the switch waits for its state file
            for_c = asyncio.create_task(serve(loras.pager, instance, c))
            await asyncio.wait([for_c], timeout=0.3)  # let the page-in run as far as it can
            release.set()
            await switching
            await for_c  # after the switch `b` is idle: it makes room for `c`
        assert loras.holdings.confirmed(instance.name) == fake.loaded == {a.lora_name, c.lora_name}
    finally:
        await loras.close()


async def test_activation_on_a_full_paging_instance_is_best_effort(fake, lora_root, tmp_path) -> None:
    """Every slot holds an adapter in use: the activation succeeds without loading (NO_ROOM is no failure on a paging
    instance, it used to roll back with 502) and the version is paged in when a Task needs it."""
    loras = paging_manager(fake, lora_root, tmp_path, page_timeout_s=0.3)
    a, b, c, d = (version_dir(lora_root, x) for x in "abcd")
    instance = Instance(fake.name, "tiny", fake.host, fake.port)
    await loras.restore()
    try:
        await activate(loras, a)
        await activate(loras, b)
        with loras.pager.using(instance, a.lora_name), loras.pager.using(instance, b.lora_name):
            answer = await activate(loras, c)
            assert answer["active_lora"]["lora_name"] == c.lora_name
            assert c.lora_name not in fake.loaded and not loras.holdings.holds(instance.name, c.lora_name)
        assert loras.snapshot("tiny:c") == (c.lora_name, c.lora_name)
        with contextlib.ExitStack() as counts:  # a Task's request for `c`: paged in on demand
            await loras.page_in(instance, c.lora_name, counts)
        assert c.lora_name in fake.loaded and loras.holdings.holds(instance.name, c.lora_name)
        fake.fail_loads = True  # a refused load still fails the switch
        with pytest.raises(LoraError) as refused:
            await activate(loras, d)
        assert refused.value.code == "lora_activation_failed"
        assert loras.snapshot("tiny:d") == ("base", "tiny")
    finally:
        await loras.close()
