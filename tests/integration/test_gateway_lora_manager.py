"""The gateway's LoRA manager against fake vLLM instances on real sockets (CONTRACT §3.3, §3.4, §3.8, §3.9)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from ipaddress import ip_network
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.instances.instance_addresses import AddressPolicy
from openjiuwen.agent_evolving.agent_rl.gateway.instances.instances import Instance, InstanceRegistry
from tests.support.gateway_errors import http_status
from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_manager import LoraError, LoraManager
from tests.support.fake_vllm import LOAD_PATH, UNLOAD_PATH, FakeVLLM

MODEL = "tiny"
V1, V2, V3 = "tiny:v1", "tiny:v2", "tiny:v3"


@pytest.fixture
def lora_root(tmp_path: Path) -> Path:
    root = tmp_path / "loras"
    for n in (1, 2, 3):
        (root / MODEL / f"v{n}").mkdir(parents=True)
    return root


@pytest.fixture
def state_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "lora-state.json"


def artifact(root: Path, n: int, model: str = MODEL) -> str:
    return str(root / model / f"v{n}")


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeVLLM]]:
    instances = [FakeVLLM(served_model=MODEL, name=f"vllm-{c}") for c in "abc"]
    await asyncio.gather(*(f.astart() for f in instances))
    try:
        yield instances
    finally:
        await asyncio.gather(*(f.astop() for f in instances))


# The fakes listen on loopback: registrations there need the operator's allowance (instance_addresses.py).
LOOPBACK_ALLOWED = AddressPolicy(allowed_networks=[ip_network("127.0.0.0/8")])


def make_manager(fakes: list[FakeVLLM], root: Path, state_path: Path, timeout_s: float = 3.0) -> LoraManager:
    registry = InstanceRegistry([Instance(f.name, f.served_model, f.host, f.port) for f in fakes])
    return LoraManager(registry, lora_root=root, state_path=state_path, operation_timeout_s=timeout_s,
                       addresses=LOOPBACK_ALLOWED)


@asynccontextmanager
async def managed(fakes: list[FakeVLLM], root: Path, state_path: Path) -> AsyncIterator[LoraManager]:
    """A LoRA manager restored from `state_path`, closed at the end (a gateway's lifetime)."""
    loras = make_manager(fakes, root, state_path)
    await loras.restore()
    try:
        yield loras
    finally:
        await loras.close()


@pytest.fixture
async def manager(fakes: list[FakeVLLM], lora_root: Path, state_path: Path) -> AsyncIterator[LoraManager]:
    async with managed(fakes, lora_root, state_path) as loras:
        yield loras


async def activate(loras: LoraManager, root: Path, n: int, expected: str, *, path: str | None = None) -> dict:
    return await loras.activate(base_model="/models/tiny", lora_name=f"{MODEL}:v{n}",
                                lora_path=path if path is not None else artifact(root, n), expected_lora_name=expected)


def pin(loras: LoraManager, model: str, *, rl_task_id: str | None = None) -> tuple[str, str]:
    """A Task start's pinning (RLControl.task_start): the policy, then its lease, with no await between."""
    policy_name, policy_model = loras.snapshot(model, rl_task_id=rl_task_id)
    loras.acquire(policy_name)
    return policy_name, policy_model


def unload_bodies(fake: FakeVLLM) -> list[dict]:
    return [r.body for r in fake.requests if r.path == UNLOAD_PATH]


def state_models(state_path: Path) -> dict:
    return json.loads(state_path.read_text())["models"]


def status_of(status: dict) -> tuple[str, str | None, int, int]:
    active = status["active_lora"]["lora_name"] if status["active_lora"] else None
    return status["status"], active, status["instances"]["ready"], status["instances"]["failed"]


# ---------------------------------------------------------------------------------------------------- activation


async def test_activation_loads_on_every_instance_and_persists(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    assert status_of(manager.status(MODEL)) == ("base", None, 3, 0)
    assert manager.snapshot(MODEL) == ("base", MODEL)

    answer = await activate(manager, lora_root, 1, "base")

    assert answer == {"status": "active", "active_lora": {"lora_name": V1, "lora_path": artifact(lora_root, 1)}}
    for fake in fakes:
        assert fake.loaded_paths == {V1: artifact(lora_root, 1)}
        assert [r.body for r in fake.requests if r.path == LOAD_PATH] == [
            {"lora_name": V1, "lora_path": artifact(lora_root, 1)}]
    assert status_of(await manager.refresh_status(MODEL)) == ("active", V1, 3, 0)
    assert manager.snapshot(MODEL) == (V1, V1)
    entry = state_models(state_path)[MODEL]
    assert (entry["lora_name"], entry["lora_path"], entry["base_model"]) == (V1, artifact(lora_root, 1), "/models/tiny")


async def test_same_artifact_again_is_idempotent(manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path) -> None:
    first = await activate(manager, lora_root, 1, "base")
    again = await activate(manager, lora_root, 1, "tiny:v7")  # whatever expected_lora_name says
    assert again == first
    assert [f.count(LOAD_PATH) for f in fakes] == [1, 1, 1]


async def test_cas_conflict_is_409_and_changes_nothing(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    with pytest.raises(LoraError) as stale:
        await activate(manager, lora_root, 2, "base")
    assert (http_status(stale.value), stale.value.code) == (409, "lora_cas_conflict")
    with pytest.raises(LoraError) as other_path:  # versions are immutable: same name, another directory
        await activate(manager, lora_root, 1, V1, path=artifact(lora_root, 2))
    assert (http_status(other_path.value), other_path.value.code) == (409, "lora_cas_conflict")
    assert manager.snapshot(MODEL) == (V1, V1)
    assert all(f.loaded == {V1} and f.count(LOAD_PATH) == 1 for f in fakes)


async def test_concurrent_activations_are_serialized(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    results = await asyncio.gather(activate(manager, lora_root, 1, "base"), activate(manager, lora_root, 2, "base"),
                                   return_exceptions=True)
    winners = [r for r in results if isinstance(r, dict)]
    losers = [r for r in results if isinstance(r, LoraError)]
    assert len(winners) == 1 and [(http_status(e), e.code) for e in losers] == [(409, "lora_cas_conflict")]
    name = winners[0]["active_lora"]["lora_name"]
    assert all(f.loaded == {name} for f in fakes)


@pytest.mark.parametrize("case", [
    "bare_model", "version_zero", "leading_zero", "blank_model", "relative", "missing", "outside_root",
    "symlink_escape", "a_file", "the_root",
])
async def test_invalid_name_or_path_is_400(
    case: str, manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere" / "v4"
    outside.mkdir(parents=True)
    (lora_root / MODEL / "v5").symlink_to(outside, target_is_directory=True)
    (lora_root / MODEL / "file").write_text("x")
    name, path = {
        "bare_model": (MODEL, artifact(lora_root, 1)),
        "version_zero": ("tiny:v0", artifact(lora_root, 1)),
        "leading_zero": ("tiny:v01", artifact(lora_root, 1)),
        "blank_model": (":v1", artifact(lora_root, 1)),
        "relative": (V1, "loras/tiny/v1"),
        "missing": (V1, str(lora_root / MODEL / "v9")),
        "outside_root": (V1, str(outside)),
        "symlink_escape": (V1, str(lora_root / MODEL / "v5")),
        "a_file": (V1, str(lora_root / MODEL / "file")),
        "the_root": (V1, str(lora_root)),
    }[case]
    with pytest.raises(LoraError) as refused:
        await manager.activate(base_model="/models/tiny", lora_name=name, lora_path=path, expected_lora_name="base")
    assert (http_status(refused.value), refused.value.code) == (400, "invalid_lora_request")
    assert all(f.count(LOAD_PATH) == 0 for f in fakes)
    assert manager.snapshot(MODEL) == ("base", MODEL)


async def test_symlink_inside_root_is_accepted(manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path) -> None:
    link = lora_root / MODEL / "current"
    link.symlink_to(lora_root / MODEL / "v1", target_is_directory=True)
    await activate(manager, lora_root, 1, "base", path=str(link))
    assert all(f.loaded_paths == {V1: str(link)} for f in fakes)


async def test_no_instances_is_503(lora_root: Path, state_path: Path, fakes: list[FakeVLLM]) -> None:
    (lora_root / "other" / "v1").mkdir(parents=True)
    loras = make_manager(fakes, lora_root, state_path)
    empty = LoraManager(InstanceRegistry(), lora_root=lora_root, state_path=state_path, operation_timeout_s=1.0,
                        addresses=LOOPBACK_ALLOWED)
    try:
        for mgr, model in ((empty, MODEL), (loras, "other")):
            with pytest.raises(LoraError) as refused:
                await mgr.activate(base_model="/m", lora_name=f"{model}:v1", lora_path=artifact(lora_root, 1, model),
                                   expected_lora_name="base")
            assert (http_status(refused.value), refused.value.code) == (503, "no_instances")
        with pytest.raises(LoraError) as no_route:
            empty.routing.pick(MODEL, MODEL)
        assert (http_status(no_route.value), no_route.value.code) == (503, "no_instances")
    finally:
        await empty.close()
        await loras.close()


async def test_partial_failure_rolls_back_and_keeps_the_previous_policy(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    a, b, c = fakes
    c.fail_next(LOAD_PATH, 500)

    with pytest.raises(LoraError) as failed:
        await activate(manager, lora_root, 2, V1)

    assert (http_status(failed.value), failed.value.code) == (502, "lora_activation_failed")
    assert "vllm-c" in failed.value.message
    assert unload_bodies(a) == unload_bodies(b) == [{"lora_name": V2}]  # the instances that loaded it
    assert unload_bodies(c) == []
    assert all(f.loaded == {V1} for f in fakes)
    assert manager.snapshot(MODEL) == (V1, V1)
    assert status_of(manager.status(MODEL)) == ("active", V1, 3, 0)
    assert state_models(state_path)[MODEL]["lora_name"] == V1
    with pytest.raises(LoraError) as unavailable:
        manager.routing.pick(MODEL, V2)
    assert (http_status(unavailable.value), unavailable.value.code) == (503, "lora_unavailable")


async def test_load_timeout_fails_within_the_deadline_and_rolls_back(
    fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    loras = make_manager(fakes, lora_root, state_path, timeout_s=0.4)
    a, b, c = fakes
    b.delay_next(LOAD_PATH, 1.0)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(LoraError) as failed:
            await activate(loras, lora_root, 1, "base")
        elapsed = asyncio.get_running_loop().time() - started

        assert (http_status(failed.value), failed.value.code) == (502, "lora_activation_failed")
        assert elapsed < 0.4 + 0.4  # one deadline for loads and rollback (the slow load takes 1 s)
        assert a.loaded == c.loaded == set()
        assert unload_bodies(a) == unload_bodies(c) == [{"lora_name": V1}]
        assert loras.snapshot(MODEL) == ("base", MODEL)
        assert not state_path.exists()

        # The slow instance finishes its load after the gateway gave up; the periodic sweep unloads it.
        await b.wait_until_async(lambda f: V1 in f.loaded, timeout_s=5)
        await loras.retry_failed()
        assert b.loaded == set()
    finally:
        await loras.close()


# ---------------------------------------------------------------------------------------------------- leases


async def test_previous_version_is_unloaded_only_when_no_task_holds_it(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    assert pin(manager, MODEL) == (V1, V1)  # a Task pinned to v1
    assert manager.leases.count(V1) == 1

    await activate(manager, lora_root, 2, V1)
    assert all(f.loaded == {V1, V2} for f in fakes)  # v1 is leased: it stays
    assert manager.routing.pick(MODEL, V1).name in {f.name for f in fakes}

    await manager.release(V1)  # the last lease
    assert all(f.loaded == {V2} for f in fakes)
    assert manager.leases.count(V1) == 0

    await activate(manager, lora_root, 3, V2)  # v2 was never leased: unloaded right after the switch
    assert all(f.loaded == {V3} for f in fakes)


async def test_leases_count_per_version_and_base_is_never_leased(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    manager.acquire("base")
    manager.acquire(MODEL)
    assert manager.leases.count("base") == manager.leases.count(MODEL) == 0
    await manager.release("base")

    await activate(manager, lora_root, 1, "base")
    manager.acquire(V1)
    manager.acquire(V1)
    await manager.deactivate(MODEL)
    await manager.release(V1)
    assert all(f.loaded == {V1} for f in fakes)  # one lease left
    await manager.release(V1)
    assert all(f.loaded == set() for f in fakes)
    await manager.release(V1)  # an extra release is harmless
    assert manager.leases.count(V1) == 0


async def test_deactivate_gives_base_at_once_while_leased_tasks_keep_their_version(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    manager.acquire(V1)
    try:
        await manager.deactivate(MODEL)
        assert manager.snapshot(MODEL) == ("base", MODEL)
        assert status_of(manager.status(MODEL)) == ("base", None, 3, 0)
        assert state_models(state_path) == {}
        assert manager.routing.pick(MODEL, V1).name in {f.name for f in fakes}  # the pinned Task still routes
        assert all(f.loaded == {V1} for f in fakes)
    finally:
        await manager.release(V1)
    assert all(f.loaded == set() for f in fakes)
    await manager.deactivate(MODEL)  # idempotent
    with pytest.raises(LoraError) as gone:
        manager.routing.pick(MODEL, V1)
    assert gone.value.code == "lora_unavailable"


async def test_lease_is_released_when_the_body_fails(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    await manager.deactivate(MODEL)
    with pytest.raises(RuntimeError):
        manager.acquire(V1)
        try:
            raise RuntimeError("client went away")
        finally:
            await manager.release(V1)
    assert manager.leases.count(V1) == 0
    assert all(f.loaded == set() for f in fakes)


# ---------------------------------------------------------------------------------------------------- routing


async def test_pick_spreads_lora_traffic_and_keeps_base_affinity(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    assert {manager.routing.pick(MODEL, V1).name for _ in range(6)} == {"vllm-a", "vllm-b", "vllm-c"}
    busy = manager.routing.pick(MODEL, V1)
    with manager.routing.in_flight(busy):
        assert all(manager.routing.pick(MODEL, V1) != busy for _ in range(4))  # least in flight first
    assert manager.routing.in_flight_count(busy.name) == 0
    sticky = {manager.routing.pick(MODEL, MODEL, affinity_key="session-42").name for _ in range(5)}
    assert len(sticky) == 1
    spread = {manager.routing.pick(MODEL, MODEL, affinity_key=f"s{i}").name for i in range(30)}
    assert len(spread) > 1
    with pytest.raises(LoraError) as unknown:
        manager.routing.pick(MODEL, "tiny:v9")
    assert (http_status(unknown.value), unknown.value.code) == (503, "lora_unavailable")


async def test_degraded_model_never_routes_the_adapter_to_an_instance_without_it(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    async with FakeVLLM(served_model=MODEL, name="vllm-d") as broken:
        broken.fail_loads = True
        await manager.register_instance(broken.name, MODEL, broken.host, broken.port)

        assert status_of(manager.status(MODEL)) == ("degraded", V1, 3, 1)
        assert manager.snapshot(MODEL) == (V1, V1)  # degraded still pins the active LoRA
        assert "vllm-d" not in {manager.routing.pick(MODEL, V1).name for _ in range(12)}
        assert "vllm-d" in {manager.routing.pick(MODEL, MODEL).name for _ in range(8)}  # it serves base traffic


async def test_register_instance_loads_the_active_adapter_and_recovers_on_retry(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    async with FakeVLLM(served_model=MODEL, name="vllm-d") as good, FakeVLLM(served_model=MODEL, name="vllm-e") as bad:
        await manager.register_instance(good.name, MODEL, good.host, str(good.port))  # the port arrives as a string
        assert good.loaded == {V1}
        assert status_of(manager.status(MODEL)) == ("active", V1, 4, 0)
        await manager.register_instance(good.name, MODEL, good.host, good.port)  # idempotent by name
        assert good.count(LOAD_PATH) == 1

        bad.fail_next(LOAD_PATH, 500)
        await manager.register_instance(bad.name, MODEL, bad.host, bad.port)
        assert status_of(manager.status(MODEL)) == ("degraded", V1, 4, 1)
        await manager.retry_failed()  # the periodic retry
        assert bad.loaded == {V1}
        assert status_of(manager.status(MODEL)) == ("active", V1, 5, 0)

        bad.drop_loras()  # vLLM restarted and registers again
        bad.fail_loads = True
        await manager.register_instance(bad.name, MODEL, bad.host, bad.port)
        assert status_of(manager.status(MODEL)) == ("degraded", V1, 4, 1)
        bad.fail_loads = False
        assert status_of(await manager.refresh_status(MODEL)) == ("active", V1, 5, 0)  # GET retries first
        assert bad.loaded == {V1}

    with pytest.raises(LoraError) as invalid:
        await manager.register_instance("x", MODEL, "127.0.0.1", "not-a-port")
    assert (http_status(invalid.value), invalid.value.code) == (400, "invalid_request")


async def test_register_instance_without_active_lora_and_unused_adapters_are_swept(
    manager: LoraManager, lora_root: Path
) -> None:
    async with FakeVLLM(served_model=MODEL, name="vllm-d") as newcomer:
        newcomer.preload("tiny:v1", artifact(lora_root, 1))  # left over from an earlier life
        await manager.register_instance(newcomer.name, MODEL, newcomer.host, newcomer.port)
        assert newcomer.loaded == set()
        assert newcomer.count(LOAD_PATH) == 0
        assert status_of(manager.status(MODEL)) == ("base", None, 4, 0)


# ---------------------------------------------------------------------------------------------------- restart


async def test_restore_after_a_restart_brings_back_the_active_lora(
    fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    first = make_manager(fakes, lora_root, state_path)
    await first.restore()
    await activate(first, lora_root, 1, "base")
    await first.close()
    fakes[0].drop_loras()  # one vLLM restarted with the gateway

    second = make_manager(fakes, lora_root, state_path)
    try:
        await second.restore()
        assert status_of(second.status(MODEL)) == ("active", V1, 3, 0)
        assert second.snapshot(MODEL) == (V1, V1)
        assert all(f.loaded == {V1} for f in fakes)
        assert {second.routing.pick(MODEL, V1).name for _ in range(6)} == {"vllm-a", "vllm-b", "vllm-c"}
        assert await activate(second, lora_root, 1, "base") == {
            "status": "active", "active_lora": {"lora_name": V1, "lora_path": artifact(lora_root, 1)}}
    finally:
        await second.close()


async def test_restore_is_degraded_when_an_instance_fails_and_recovers(
    fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    first = make_manager(fakes, lora_root, state_path)
    await activate(first, lora_root, 1, "base")
    await first.close()
    a = fakes[0]
    a.drop_loras()
    a.fail_loads = True

    second = make_manager(fakes, lora_root, state_path)
    try:
        await second.restore()
        assert status_of(second.status(MODEL)) == ("degraded", V1, 2, 1)
        assert "vllm-a" not in {second.routing.pick(MODEL, V1).name for _ in range(12)}
        a.fail_loads = False
        await second.retry_failed()
        assert status_of(second.status(MODEL)) == ("active", V1, 3, 0)
        assert a.loaded == {V1}
    finally:
        await second.close()


async def test_restore_is_degraded_when_the_artifact_is_missing(
    fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    first = make_manager(fakes, lora_root, state_path)
    await activate(first, lora_root, 1, "base")
    await first.close()
    shutil.rmtree(artifact(lora_root, 1))
    for fake in fakes:
        fake.drop_loras()
        fake.clear()

    second = make_manager(fakes, lora_root, state_path)
    try:
        await second.restore()
        assert status_of(second.status(MODEL)) == ("degraded", V1, 0, 3)
        assert second.snapshot(MODEL) == (V1, V1)  # explicit, never silently base
        assert all(f.count(LOAD_PATH) == 0 for f in fakes)
        with pytest.raises(LoraError) as unavailable:
            second.routing.pick(MODEL, V1)
        assert (http_status(unavailable.value), unavailable.value.code) == (503, "lora_unavailable")
    finally:
        await second.close()


async def test_restore_without_state_file_is_base_and_unloads_leftovers(
    fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    fakes[1].preload(V2, artifact(lora_root, 2))  # a vLLM that outlived a gateway with another state
    loras = make_manager(fakes, lora_root, state_path)
    try:
        await loras.restore()
        assert status_of(loras.status(MODEL)) == ("base", None, 3, 0)
        assert fakes[1].loaded == set()
        assert not state_path.exists()
    finally:
        await loras.close()


async def test_corrupt_state_file_refuses_to_guess(fakes: list[FakeVLLM], lora_root: Path, state_path: Path) -> None:
    state_path.parent.mkdir(parents=True)
    state_path.write_text("{not json")
    loras = make_manager(fakes, lora_root, state_path)
    try:
        with pytest.raises(LoraError) as corrupt:
            await loras.restore()
        assert (http_status(corrupt.value), corrupt.value.code) == (500, "invalid_lora_state")
    finally:
        await loras.close()


async def test_state_file_is_replaced_atomically(
    manager: LoraManager, lora_root: Path, state_path: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    await activate(manager, lora_root, 2, V1)
    await manager.deactivate(MODEL)
    await activate(manager, lora_root, 3, "base")
    assert [p.name for p in state_path.parent.iterdir()] == [state_path.name]  # no temporary file left
    data = json.loads(state_path.read_text())
    assert data["version"] == 1
    assert {m: (e["lora_name"], e["lora_path"]) for m, e in data["models"].items()} == {
        MODEL: (V3, artifact(lora_root, 3))}


async def test_closed_manager_refuses_operations(fakes: list[FakeVLLM], lora_root: Path, state_path: Path) -> None:
    loras = make_manager(fakes, lora_root, state_path)
    await loras.close()
    await loras.close()  # idempotent
    with pytest.raises(LoraError) as closed:
        await activate(loras, lora_root, 1, "base")
    assert http_status(closed.value) == 503
