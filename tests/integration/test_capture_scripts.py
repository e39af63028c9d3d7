"""The capture hooks' Lua scripts (online/capture/scripts.py) against the WATCH/MULTI/EXEC transactions they
replaced, and the in-process memories they verify.

- Differential: the transactions as they were (reserve, commit, discard; kept below as the oracle) and the scripts
  run the same random sequence of operations, on two Tasks of the same spec in one Redis, with random changes of
  the turn keys applied to both between operations. Every operation must end alike (result, or error type and
  message) and leave the same keys with the same bytes (timestamps aside: they are checked for form).
- Several service processes: the script side runs on two registries at random, so a commit often finds no
  reservation of its own in memory (the two-round-trip path).
- NOSCRIPT: after SCRIPT FLUSH and after a Redis restart (script cache empty), hooks work unchanged.
- Task identity: an id whose record expired and was started again as another Task is validated against the new
  Task, and a remembered Task that is gone answers 404 first, as the read the memory replaces did.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from openjiuwen.agent_evolving.agent_rl.common.ids import now_iso, parse_iso_epoch
from openjiuwen.agent_evolving.agent_rl.online import events
from openjiuwen.agent_evolving.agent_rl.online.errors import Conflict, NotFound
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample, text
from openjiuwen.agent_evolving.agent_rl.online.store.tx import transact
from openjiuwen.agent_evolving.agent_rl.online.tasks.task_records import (
    CaptureMeta, CaptureStatus, FinishReason, RewardMode, Task, TaskStatus,
)
from openjiuwen.agent_evolving.agent_rl.online.capture.ledger import (
    AbortingConflict, CaptureLedger, Reservation, ReserveOutcome,
)
from openjiuwen.agent_evolving.agent_rl.online.tasks.registry import TaskRegistry
from tests.conftest import load_fixture
from tests.support.redis_server import RedisServer
from tests.support.service_app import make_config, running_app, start_task

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00")


# ---------------------------------------------------------------------------------------- the oracle (as it was)


async def _read_task_and(pipe: Pipeline, task_key: str, other_key: str) -> tuple[Task, bytes | None]:
    raw_task, raw = await pipe.mget(task_key, other_key)
    if raw_task is None:
        raise NotFound("RL Task not found")
    return Task.from_json(raw_task), raw


async def oracle_reserve(redis: Redis, task: Task, capture_id: str, turn_id: str | None, fp: str) -> Reservation:
    t = task.rl_task_id
    task_key, capture_key = keys.task(t), keys.capture(t, capture_id)
    watch = [task_key, capture_key]
    if task.delayed:
        watch += [keys.turn_current(t), keys.turn_transition(t), keys.turns_closed(t), keys.turn_publish(t, turn_id)]

    async def body(pipe: Pipeline) -> Reservation:
        current_task, raw = await _read_task_and(pipe, task_key, capture_key)
        if raw is not None:
            meta = CaptureMeta.from_json(raw)
            if meta.agent_turn_id == turn_id and meta.request_fingerprint == fp:
                return Reservation(ReserveOutcome.IDEMPOTENT)
            raise Conflict("capture_id already used with different input")
        if not current_task.active:
            raise Conflict("RL Task is not active")
        set_current = False
        if current_task.delayed:
            if await pipe.sismember(keys.turns_closed(t), turn_id) or await pipe.exists(keys.turn_publish(t, turn_id)):
                raise AbortingConflict(f"turn {turn_id} is closed")
            current = text(await pipe.get(keys.turn_current(t)))
            transition = text(await pipe.get(keys.turn_transition(t)))
            if current is None:
                set_current = True
            elif current == turn_id:
                if transition is not None:
                    raise AbortingConflict(f"turn {turn_id} is closing")
            else:
                if transition is not None and transition != turn_id:
                    raise Conflict(f"turn {transition} is already waiting for {current}")
                if transition is None:
                    pipe.multi()
                    pipe.set(keys.turn_transition(t), turn_id)
                    await pipe.execute()
                return Reservation(ReserveOutcome.PUBLISH_CURRENT, current_turn=current)
        meta = CaptureMeta(capture_id, turn_id, fp, None, CaptureStatus.OPEN, now_iso())
        pipe.multi()
        if set_current:
            pipe.set(keys.turn_current(t), turn_id)
        pipe.set(capture_key, meta.to_json())
        pipe.sadd(keys.captures(t), capture_id)
        pipe.sadd(keys.open_captures(t), capture_id)
        events.queue(pipe, keys.task_events(t), "capture_reserved",
                     {"capture_id": capture_id, "agent_turn_id": turn_id}, at=meta.created_at)
        await pipe.execute()
        return Reservation(ReserveOutcome.RESERVED)

    return await transact(redis, body, *watch)


async def oracle_commit(redis: Redis, t: str, capture_id: str, turn_id: str | None, fp: str, rfp: str,
                        sample: PackedSample | None) -> bool:
    task_key, capture_key = keys.task(t), keys.capture(t, capture_id)

    async def body(pipe: Pipeline) -> bool:
        task, raw = await _read_task_and(pipe, task_key, capture_key)
        if raw is None:
            raise Conflict("capture has no matching before")
        meta = CaptureMeta.from_json(raw)
        if meta.agent_turn_id != turn_id:
            raise Conflict("agent_turn_id differs from the one seen at before")
        if meta.request_fingerprint != fp:
            raise Conflict("request differs from the one seen at before")
        if meta.status == CaptureStatus.COMMITTED:
            if meta.response_fingerprint == rfp:
                return False
            raise Conflict("capture already committed with a different response")
        if not task.active:
            raise Conflict("RL Task is not active")
        if sample is None:
            raise Conflict("capture is not committed")
        sample.meta["completion_latency_ms"] = round(
            max(0.0, (parse_iso_epoch(now_iso()) - parse_iso_epoch(meta.created_at)) * 1000.0), 3
        )
        committed = CaptureMeta(meta.capture_id, meta.agent_turn_id, meta.request_fingerprint, rfp,
                                CaptureStatus.COMMITTED, meta.created_at)
        pipe.multi()
        pipe.set(capture_key, committed.to_json())
        pipe.set(keys.staged(t, capture_id), sample.encode_staged())
        pipe.srem(keys.open_captures(t), capture_id)
        pipe.sadd(keys.committed_captures(t), capture_id)
        if turn_id is not None:
            pipe.sadd(keys.turn_captures(t, turn_id), capture_id)
        events.queue(pipe, keys.task_events(t), "capture_committed", {"capture_id": capture_id,
                                                                       "agent_turn_id": turn_id})
        await pipe.execute()
        return True

    return await transact(redis, body, task_key, capture_key)


async def oracle_discard(redis: Redis, t: str, capture_id: str, turn_id: str | None) -> bool:
    task_key, capture_key = keys.task(t), keys.capture(t, capture_id)

    async def body(pipe: Pipeline) -> bool:
        task, raw = await _read_task_and(pipe, task_key, capture_key)
        if raw is None or not task.active:
            return False
        meta = CaptureMeta.from_json(raw)
        if meta.status == CaptureStatus.COMMITTED:
            raise Conflict("capture is already committed")
        if meta.agent_turn_id != turn_id:
            raise Conflict("agent_turn_id differs from the one seen at before")
        pipe.multi()
        pipe.delete(capture_key)
        pipe.srem(keys.captures(t), capture_id)
        pipe.srem(keys.open_captures(t), capture_id)
        events.queue(pipe, keys.task_events(t), "capture_discarded", {"capture_id": capture_id,
                                                                       "agent_turn_id": turn_id})
        await pipe.execute()
        return True

    return await transact(redis, body, task_key, capture_key)


# -------------------------------------------------------------------------------------------- state snapshots


def _stamp(value: Any) -> str:
    assert isinstance(value, str) and ISO.fullmatch(value), value
    return "<time>"


async def snapshot(redis: Redis, t: str) -> dict[str, Any]:
    """Every key of Task t, named without t, with timestamps replaced once their form is checked."""
    prefix = keys.task(t)
    names = sorted([k.decode() async for k in redis.scan_iter(match=prefix + "*", count=1000)])
    async with redis.pipeline(transaction=False) as pipe:
        for key in names:
            pipe.type(key)
            pipe.ttl(key)
        kinds_ttls = await pipe.execute()
    kinds = [k.decode() for k in kinds_ttls[::2]]
    assert set(kinds_ttls[1::2]) <= {-1}, names  # no TTL on anything of an active Task
    async with redis.pipeline(transaction=False) as pipe:
        for key, kind in zip(names, kinds):
            {"set": pipe.smembers, "stream": pipe.xrange, "string": pipe.get}[kind](key)
        values = await pipe.execute()
    out: dict[str, Any] = {}
    for key, kind, value in zip(names, kinds, values):
        name = "task" + key[len(prefix):]
        if kind == "set":
            out[name] = sorted(value)
        elif kind == "stream":
            entries = []
            for _, fields in value:
                assert list(fields) == [b"type", b"at", b"data"], fields  # field order as events.py writes it
                data = fields[b"data"].replace(f"s-{t}".encode(), b"<session>")  # the `created` event's
                entries.append((fields[b"type"], _stamp(fields[b"at"].decode()), data))
            out[name] = entries
        elif ":pending:" in key:
            sample = PackedSample.decode_staged(value)
            latency = sample.meta.pop("completion_latency_ms")
            assert isinstance(latency, float) and latency >= 0
            out[name] = (sample.meta, sample.prompt_ids, sample.response_ids, sample.response_logprobs)
        elif ":capture:" in key:
            meta = orjson.loads(value)
            assert value == orjson.dumps(meta, option=orjson.OPT_SORT_KEYS)  # the bytes CaptureMeta writes
            meta["created_at"] = _stamp(meta["created_at"])
            out[name] = meta
        elif name == "task":
            record = orjson.loads(value)
            for field in ("created_at", "finished_at"):
                record[field] = record[field] and _stamp(record[field])
            record.pop("rl_task_id"), record.pop("agent_session_id")
            out[name] = record
        else:
            out[name] = value
    return out


async def _outcome(call: Any) -> Any:
    try:
        result = await call
    except (Conflict, NotFound) as exc:
        return type(exc).__name__, exc.message
    return result


def _sample(i: int) -> PackedSample:
    return PackedSample({"n": i, "text": "word " * (i % 90)}, bytes(range(i % 50)) * 4, b"\x01\x00\x00\x00" * 3,
                        b"\x00\x00\x80\xbf" * 3)


@pytest.mark.parametrize("mode", [RewardMode.TERMINAL, RewardMode.DELAYED_FEEDBACK])
async def test_scripts_do_what_the_transactions_did(redis, mode):
    delayed = mode == RewardMode.DELAYED_FEEDBACK
    seen: set[str] = set()
    for seed in range(4):
        await _differential(redis, mode, random.Random(seed), seen, (f"ta{seed}", f"tb{seed}"),
                            "abort" if seed % 2 else "inactive")
    # The sequences went through the interesting branches, not only the first few (the commit's and discard's
    # checks are the same in both modes; the delayed sequences are there for the turn machine).
    expected = {"reserve:reserved", "reserve:idempotent", "commit:True", "discard:True", "discard:False",
                "reserve:('Conflict', 'RL Task is not active')",
                "reserve:('Conflict', 'capture_id already used with different input')",
                "commit:('Conflict', 'capture has no matching before')",
                "commit:('Conflict', 'request differs from the one seen at before')"}
    if delayed:
        expected |= {"reserve:publish_current", "commit:('Conflict', 'agent_turn_id differs from the one seen at before')",
                     "discard:('Conflict', 'agent_turn_id differs from the one seen at before')"}
        assert {o for o in seen if "AbortingConflict" in o and "closed" in o}, sorted(seen)
        assert {o for o in seen if "AbortingConflict" in o and "closing" in o}, sorted(seen)
        assert {o for o in seen if "already waiting" in o}, sorted(seen)
    else:
        expected |= {"commit:False", "commit:('Conflict', 'capture already committed with a different response')",
                     "commit:('Conflict', 'capture is not committed')", "commit:('Conflict', 'RL Task is not active')",
                     "discard:('Conflict', 'capture is already committed')"}
    assert expected <= seen, sorted(expected - seen)


async def _differential(redis: Redis, mode: RewardMode, rng: random.Random, seen: set[str],
                        ids: tuple[str, str], end: str) -> None:
    """`end`: how the Task stops being active late in the sequence: `abort`, or `inactive` (its record rewritten as
    finalized while captures are open, which no real path does, to reach the commit's last check)."""
    delayed = mode == RewardMode.DELAYED_FEEDBACK
    registry = TaskRegistry(redis)
    processes = [CaptureLedger(redis, signals=registry.signals),  # two service processes on one database
                 CaptureLedger(redis, signals=registry.signals)]
    tasks = {}
    for side, t in zip(("oracle", "scripts"), ids):
        task, created = await registry.start(Task(t, f"s-{t}", "tiny", "base", mode.value, TaskStatus.ACTIVE,
                                                      now_iso()))
        assert created
        tasks[side] = task
    for step in range(240):
        op = rng.choice(["reserve"] * 4 + ["commit"] * 4 + ["discard"] * 2 + ["turns"]
                        + ["abort" if step > 150 and end == "abort" else "turns"])
        if step == 190 and end == "inactive":
            op = "inactive"
        c = f"c{rng.randrange(step // 30, step // 30 + 4)}"  # a window of ids moving on: fresh ones keep coming
        turns = [f"u{i}" for i in range(step // 40, step // 40 + 3)]  # turns move on too
        turn = (turns[0] if rng.random() < 0.8 else rng.choice(turns)) if delayed else rng.choice([None, None, "u1"])
        fp, rfp = rng.choice(["fp1", "fp1", "fp2"]), rng.choice(["r1", "r1", "r2"])
        sample_i = rng.randrange(1000)
        with_sample = rng.random() < 0.9  # None: a caller that knows the capture is committed
        if op == "turns":  # the turn machine's other writers, done alike to both Tasks
            changes = [(kind, rng.choice(turns + ([None] if kind == "transition" else [])))
                       for kind in ("current", "transition", "closed", "publish") if rng.random() < 0.2]
            for task in tasks.values():
                t = task.rl_task_id
                for kind, u in changes:
                    if kind == "current":
                        await redis.set(keys.turn_current(t), u)
                    elif kind == "transition":
                        await (redis.delete(keys.turn_transition(t)) if u is None else
                               redis.set(keys.turn_transition(t), u))
                    elif kind == "closed":
                        await redis.sadd(keys.turns_closed(t), u)
                    else:
                        await redis.set(keys.turn_publish(t, u), "published")
            continue
        if op == "inactive":  # a record no longer active with captures still open (no real path leaves that)
            for task in tasks.values():
                record = Task.from_json(await redis.get(keys.task(task.rl_task_id)))
                await redis.set(keys.task(task.rl_task_id), replace(record, status="finalized").to_json())
            continue
        if op == "abort":
            for task in tasks.values():
                await registry.abort(task.rl_task_id, FinishReason.CAPTURE_FAILED)
            continue
        ledger = rng.choice(processes)
        results = {}
        for side, task in tasks.items():
            t = task.rl_task_id
            if op == "reserve":
                if delayed and turn is None:
                    continue
                call = (oracle_reserve(redis, task, c, turn, fp) if side == "oracle"
                        else ledger.reserve(task, c, turn, fp))
            elif op == "commit":
                sample = _sample(sample_i) if with_sample else None
                call = (oracle_commit(redis, t, c, turn, fp, rfp, sample) if side == "oracle"
                        else ledger.commit(task, c, turn, fp, rfp, None if sample is None else [sample]))
            else:
                call = (oracle_discard(redis, t, c, turn) if side == "oracle" else ledger.discard(t, c, turn))
            try:
                results[side] = await _outcome(call)
            except AbortingConflict as exc:
                results[side] = ("AbortingConflict", exc.message)
        assert results["oracle"] == results["scripts"], (step, op, c, turn, fp, rfp, results)
        if results:
            outcome = results["oracle"]
            seen.add(f"{op}:{outcome.outcome.value if isinstance(outcome, Reservation) else outcome}")
        assert await snapshot(redis, ids[0]) == await snapshot(redis, ids[1]), (step, op, c, turn, results)


async def test_unknown_task_and_events_trimmed(redis):
    registry = TaskRegistry(redis)
    ledger = CaptureLedger(redis, signals=registry.signals)
    ghost = Task("tghost", "s", "tiny", "base", "terminal", TaskStatus.ACTIVE, now_iso())
    for call in (ledger.reserve(ghost, "c1", None, "fp"), ledger.commit(ghost, "c1", None, "fp", "r", [_sample(1)]),
                 ledger.discard("tghost", "c1", None)):
        with pytest.raises(NotFound, match="RL Task not found"):
            await call
    task, _ = await registry.start(Task("t1", "s1", "tiny", "base", "terminal", TaskStatus.ACTIVE, now_iso()))
    for i in range(1100):  # XADD MAXLEN ~ 1000, as every transition event
        await ledger.reserve(task, f"c{i}", None, "fp")
    length = await redis.xlen(keys.task_events("t1"))
    assert events.MAXLEN <= length < 1100


# ------------------------------------------------------------------------------------------------- NOSCRIPT


REQUEST, RESPONSE = load_fixture("chat_request.json"), load_fixture("chat_response.json")


async def _capture(client: Any, c: str) -> None:
    hook = {"rl_task_id": "t1", "capture_id": c, "agent_turn_id": None}
    before = await client.post("/internal/v1/completions:before", json={**hook, "request": REQUEST})
    assert before.status_code == 200, before.text
    after = await client.post("/internal/v1/completions:after",
                              json={**hook, "request": before.json()["request"], "response": RESPONSE})
    assert after.status_code == 204, after.text
    assert (await client.post("/internal/v1/completions:discard", json=hook)).status_code == 409


async def test_scripts_are_loaded_again_after_a_script_flush(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (_, client):
        assert (await start_task(client, "s1", "t1")).status_code == 201
        await _capture(client, "c1")
        await redis.script_flush()
        await _capture(client, "c2")
        assert (await client.get("/v1/rl/tasks/t1")).json()["status"] == "active"


async def test_scripts_are_loaded_again_after_a_redis_restart(tmp_path):
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        async with running_app(make_config(server.url, tmp_path)) as (_, client):
            assert (await start_task(client, "s1", "t1")).status_code == 201
            await _capture(client, "c1")
            server.kill()  # a crash: the script cache is gone, the data comes back from the AOF
            server.start()
            for attempt in range(50):  # the client's pool reconnects on its next command
                try:
                    await _capture(client, "c2")
                    break
                except AssertionError:
                    if attempt == 49:
                        raise
            assert (await client.post("/v1/rl/tasks/t1/stop")).json()["status"] == "finalized"


# -------------------------------------------------------------------------------------------- Task identity


async def test_a_task_id_started_again_is_validated_as_the_new_task(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (app, client):
        assert (await start_task(client, "s1", "t1")).status_code == 201
        await _capture(client, "c1")  # the process now remembers t1's facts
        # The record expired and the gateway started the id again, pinned to another model.
        async for key in redis.scan_iter(match="rl:v1:*t1*"):
            await redis.delete(key)
        await redis.delete(keys.active_session("s1"))
        await redis.srem(keys.ACTIVE_TASKS, "t1")
        again = await start_task(client, "s2", "t1", model="other-model")
        assert again.status_code == 201, again.text
        hook = {"rl_task_id": "t1", "capture_id": "c2", "agent_turn_id": None}
        r = await client.post("/internal/v1/completions:before", json={**hook, "request": REQUEST})
        assert (r.status_code, r.json()["error"]["message"]) == (409, "request model does not match Task policy")
        r = await client.post("/internal/v1/completions:before",
                              json={**hook, "request": {**REQUEST, "model": "other-model"}})
        assert r.status_code == 200, r.text
        response = {**RESPONSE, "model": "other-model"}
        r = await client.post("/internal/v1/completions:after",
                              json={**hook, "request": r.json()["request"], "response": response})
        assert r.status_code == 204, r.text
        staged = PackedSample.decode_staged(await redis.get(keys.staged("t1", "c2")))
        assert staged.meta["session_id"] == "s2"  # built from the new Task, not the remembered one
        assert app.state.deps.ledger._facts["t1"].agent_session_id == "s2"


async def test_a_remembered_task_that_is_gone_is_404_before_any_other_check(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (_, client):
        assert (await start_task(client, "s1", "t1")).status_code == 201
        await _capture(client, "c1")
        async for key in redis.scan_iter(match="rl:v1:task:t1*"):
            await redis.delete(key)
        hook = {"rl_task_id": "t1", "capture_id": "c2", "agent_turn_id": None}
        for path, body in (
            ("before", {**hook, "request": {**REQUEST, "model": "wrong"}}),  # would be 409 for a live Task
            ("after", {**hook, "request": REQUEST, "response": {**RESPONSE, "object": "nope"}}),  # 400 and abort
            ("before", {**hook, "request": REQUEST}),
            ("discard", hook),
        ):
            r = await client.post(f"/internal/v1/completions:{path}", json=body)
            assert (r.status_code, r.json()["error"]) == (
                404, {"code": "completion_conflict", "message": "RL Task not found"}), path


async def test_a_commit_in_another_process_than_its_reservation(redis, redis_url, tmp_path):
    async with running_app(make_config(redis_url, tmp_path)) as (_, a), \
            running_app(make_config(redis_url, Path(tmp_path) / "b")) as (_, b):
        assert (await start_task(a, "s1", "t1")).status_code == 201
        hook = {"rl_task_id": "t1", "capture_id": "c1", "agent_turn_id": None}
        before = await a.post("/internal/v1/completions:before", json={**hook, "request": REQUEST})
        after = {**hook, "request": before.json()["request"], "response": RESPONSE}
        assert (await b.post("/internal/v1/completions:after", json=after)).status_code == 204
        assert (await a.post("/internal/v1/completions:after", json=after)).status_code == 204  # idempotent
        staged = PackedSample.decode_staged(await redis.get(keys.staged("t1", "c1")))
        assert staged.meta["completion_latency_ms"] >= 0
        assert await redis.smembers(keys.committed_captures("t1")) == {b"c1"}
        assert await redis.xlen(keys.task_events("t1")) == 3  # created, reserved, committed once
