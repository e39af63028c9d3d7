"""The gateway's canary candidate against fake vLLM instances on real sockets (docs/rollout.md, CONTRACT §3.8 ext):
loaded everywhere beside the active version, a deterministic share of new Tasks, CAS on start / promote / abort,
leases kept whatever happens to it, persisted across a gateway restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.lora.canary import in_candidate_arm, split_point
from tests.support.gateway_errors import http_status
from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_manager import LoraError, LoraManager
from tests.integration.test_gateway_lora_manager import (  # noqa: F401  (fixtures)
    MODEL, V1, V2, V3, activate, artifact, fakes, lora_root, make_manager, manager, pin, state_path,
)
from tests.support.fake_vllm import FakeVLLM

BASE_MODEL = "/models/tiny"


async def start(loras: LoraManager, root: Path, n: int, expected: str, share: object = 0.5) -> dict:
    return await loras.start_canary(base_model=BASE_MODEL, lora_name=f"{MODEL}:v{n}", lora_path=artifact(root, n),
                                    expected_lora_name=expected, share=share)


def arms(loras: LoraManager, n: int = 400) -> dict[str, int]:
    counts: dict[str, int] = {}
    for i in range(n):
        name, _ = loras.snapshot(MODEL, rl_task_id=f"t{i:032x}")
        counts[name] = counts.get(name, 0) + 1
    return counts


async def test_candidate_is_loaded_everywhere_and_takes_its_share_of_new_tasks(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    answer = await start(manager, lora_root, 2, V1, share=0.25)

    assert answer["active_lora"]["lora_name"] == V1
    assert answer["candidate"]["lora_name"] == V2 and answer["candidate"]["share"] == 0.25
    assert answer["candidate"]["instances"] == {"ready": 3}
    assert all(f.loaded == {V1, V2} for f in fakes)
    assert manager.status(MODEL)["candidate"]["lora_name"] == V2  # the internal GET reports it
    persisted = json.loads(state_path.read_text())
    assert persisted["models"][MODEL]["lora_name"] == V1 and persisted["candidates"][MODEL]["lora_name"] == V2
    counts = arms(manager)
    assert set(counts) == {V1, V2} and 60 <= counts[V2] <= 140  # about a quarter of 400
    # Deterministic per Task: the same id always lands in the same arm; outside a Task never the candidate.
    task = next(f"t{i:032x}" for i in range(400) if in_candidate_arm(f"t{i:032x}", 0.25))
    assert {manager.snapshot(MODEL, rl_task_id=task) for _ in range(5)} == {(V2, V2)}
    assert manager.snapshot(MODEL) == (V1, V1)
    assert 0.0 <= split_point(task) < 0.25


async def test_start_is_compare_and_swap_and_one_candidate_at_a_time(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    with pytest.raises(LoraError) as stale:
        await start(manager, lora_root, 2, "base")
    assert (http_status(stale.value), stale.value.code) == (409, "lora_cas_conflict")
    with pytest.raises(LoraError) as active_again:
        await start(manager, lora_root, 1, V1)
    assert (http_status(active_again.value), active_again.value.code) == (409, "lora_cas_conflict")
    for bad in (0, 1, 1.5, -0.1, "0.5", True, float("nan")):
        with pytest.raises(LoraError) as invalid:
            await start(manager, lora_root, 2, V1, share=bad)
        assert (http_status(invalid.value), invalid.value.code) == (400, "invalid_lora_request")
    assert manager.candidate(MODEL) is None and all(f.loaded == {V1} for f in fakes)

    first = await start(manager, lora_root, 2, V1)
    again = await start(manager, lora_root, 2, V1)  # a lost answer repeated: idempotent
    assert again["candidate"] == first["candidate"]
    with pytest.raises(LoraError) as second:
        await start(manager, lora_root, 3, V1)
    assert (http_status(second.value), second.value.code) == (409, "canary_conflict")
    with pytest.raises(LoraError) as activation:  # a plain activation would leave a candidate without its arm
        await activate(manager, lora_root, 3, V1)
    assert (http_status(activation.value), activation.value.code) == (409, "canary_conflict")
    assert all(f.loaded == {V1, V2} for f in fakes)


async def test_promote_switches_with_cas_and_pinned_tasks_keep_the_old_version(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    await start(manager, lora_root, 2, V1)
    manager.acquire(V1)  # a Task pinned to the active version

    for name, expected in ((V3, V1), (V2, "base")):
        with pytest.raises(LoraError) as wrong:
            await manager.promote_canary(base_model=BASE_MODEL, lora_name=name, expected_lora_name=expected)
        assert (http_status(wrong.value), wrong.value.code) == (409, "lora_cas_conflict")

    answer = await manager.promote_canary(base_model=BASE_MODEL, lora_name=V2, expected_lora_name=V1)
    assert answer["active_lora"]["lora_name"] == V2 and answer["candidate"] is None
    assert manager.snapshot(MODEL, rl_task_id="t" + "0" * 32) == (V2, V2)
    assert all(f.loaded == {V1, V2} for f in fakes)  # V1 is still leased
    persisted = json.loads(state_path.read_text())
    assert persisted["models"][MODEL]["lora_name"] == V2 and "candidates" not in persisted
    again = await manager.promote_canary(base_model=BASE_MODEL, lora_name=V2, expected_lora_name=V1)
    assert again["active_lora"]["lora_name"] == V2
    await manager.release(V1)
    assert all(f.loaded == {V2} for f in fakes)
    with pytest.raises(LoraError) as none:
        await manager.promote_canary(base_model=BASE_MODEL, lora_name=V3, expected_lora_name=V2)
    assert (http_status(none.value), none.value.code) == (409, "no_canary")


async def test_abort_keeps_the_candidate_loaded_while_a_task_is_pinned_to_it(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    await start(manager, lora_root, 2, V1, share=0.5)
    task = next(f"t{i:032x}" for i in range(100) if in_candidate_arm(f"t{i:032x}", 0.5))
    assert pin(manager, MODEL, rl_task_id=task) == (V2, V2)

    with pytest.raises(LoraError) as wrong:
        await manager.abort_canary(base_model=BASE_MODEL, lora_name=V3)
    assert (http_status(wrong.value), wrong.value.code) == (409, "lora_cas_conflict")
    answer = await manager.abort_canary(base_model=BASE_MODEL, lora_name=V2)
    assert answer["candidate"] is None and answer["active_lora"]["lora_name"] == V1
    assert manager.snapshot(MODEL, rl_task_id=task) == (V1, V1)  # new Tasks: all on the active version
    assert manager.routing.pick(MODEL, V2).name in {f.name for f in fakes}  # the pinned Task keeps its version
    assert all(f.loaded == {V1, V2} for f in fakes)
    assert "candidates" not in json.loads(state_path.read_text())
    assert (await manager.abort_canary(base_model=BASE_MODEL, lora_name=V2))["candidate"] is None  # idempotent
    await manager.release(V2)
    assert all(f.loaded == {V1} for f in fakes)
    with pytest.raises(LoraError) as promoted:  # aborting what is active would be a lie
        await manager.abort_canary(base_model=BASE_MODEL, lora_name=V1)
    assert (http_status(promoted.value), promoted.value.code) == (409, "lora_cas_conflict")


async def test_candidate_survives_a_gateway_restart(
    fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    first = make_manager(fakes, lora_root, state_path)
    await first.restore()
    await start(first, lora_root, 1, "base", share=0.3)  # a first version can be a canary against base
    before = arms(first)
    await first.close()
    fakes[1].drop_loras()  # one vLLM restarted with the gateway

    second = make_manager(fakes, lora_root, state_path)
    try:
        await second.restore()
        assert second.candidate(MODEL) is not None and second.candidate(MODEL).share == 0.3
        assert second.status(MODEL)["status"] == "base"
        assert all(f.loaded == {V1} for f in fakes)
        assert arms(second) == before  # the same Tasks land in the same arms
        with pytest.raises(LoraError) as conflict:
            await start(second, lora_root, 2, "base")
        assert conflict.value.code == "canary_conflict"
    finally:
        await second.close()


async def test_retry_loads_the_candidate_on_an_instance_that_lost_it(
    manager: LoraManager, fakes: list[FakeVLLM], lora_root: Path
) -> None:
    await activate(manager, lora_root, 1, "base")
    await start(manager, lora_root, 2, V1)
    fakes[2].drop_loras()
    await manager.readmit(next(i for i in manager._registry.all() if i.name == fakes[2].name))
    assert fakes[2].loaded == {V1, V2}


async def test_corrupt_candidate_entry_refuses_to_guess(
    fakes: list[FakeVLLM], lora_root: Path, state_path: Path
) -> None:
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state_path.write_text(json.dumps({"version": 1, "models": {}, "candidates": {
        MODEL: {"lora_name": V1, "lora_path": artifact(lora_root, 1), "share": 2}}}))
    loras = make_manager(fakes, lora_root, state_path)
    try:
        with pytest.raises(LoraError) as bad:
            await loras.restore()
        assert (http_status(bad.value), bad.value.code) == (500, "invalid_lora_state")
    finally:
        await loras.close()
