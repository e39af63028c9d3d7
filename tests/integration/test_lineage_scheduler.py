"""Automatic training over lineages (docs/lineages.md, issue 27 item 3) with real Redis, the scripted trainer and a
fake gateway on a real socket: the scheduler finds the lines with pending samples through the waiting hint
(`rl:v1:training:waiting`), never by reading every registered lineage, trains the longest-waiting first, corrects the
hint after claims, skips paused lineages and judges each line under its lineage's override.

As in test_auto_training.py the loop's poll interval is an hour and each test calls `scheduler.tick()` itself.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from openjiuwen.agent_evolving.agent_rl.online.capture.response import validate_response
from openjiuwen.agent_evolving.agent_rl.online.capture.sample import build_sample
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.tasks.task_records import Task
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from tests.integration.test_training_runs import REQUEST, RESPONSE
from tests.support.fake_gateway import FakeGateway
from tests.support.invariants import check_invariants
from tests.support.service_app import MODEL_ID, make_config, running_app
from tests.support.runs import wait_for_run

_counter = iter(range(1_000_000))
LINEAGES = [f"l{i:02d}" for i in range(50)]


def line(lineage: str) -> str:
    return f"{MODEL_ID}:{lineage}"


async def publish(deps, lineage: str, count: int, *, age_s: float, policy: str = "base") -> list[str]:
    """`count` pending samples of `lineage` served by `policy`, the oldest created `age_s` seconds ago (one
    microsecond apart)."""
    ids = []
    for _ in range(count):
        i = next(_counter)
        task = Task(f"t{i}", f"s{i}", MODEL_ID, policy, "terminal", "finalized", "2026-01-01T00:00:00+00:00",
                    lineage=lineage)
        sample = build_sample(task, capture_id=f"c{i:05d}", agent_turn_id=None, request=REQUEST, response=RESPONSE,
                              validated=validate_response(RESPONSE, policy_model=MODEL_ID))
        sample.meta["created_at"] = datetime.fromtimestamp(time.time() - age_s + len(ids) * 1e-3, UTC).isoformat()
        sample.meta["judge"] = {"score": 1.0, "source": "terminal"}
        assert await deps.store.insert_if_absent([sample]) == [f"c{i:05d}"]
        ids.append(f"c{i:05d}")
    return ids


async def hint(redis) -> dict[str, float]:
    return {m.decode(): s for m, s in await redis.zrange(keys.TRAINING_WAITING, 0, -1, withscores=True)}


async def head(redis, lineage: str) -> float:
    [(_, score)] = await redis.zrange(keys.traj_index(line(lineage), "pending"), 0, 0, withscores=True)
    return score


@pytest.fixture
async def gateway():
    async with FakeGateway(model_id=MODEL_ID) as gw:
        yield gw


@pytest.fixture
def app(redis, redis_url, tmp_path, gateway):
    def factory(policy: dict | None = None, **overrides):
        config = make_config(
            redis_url, tmp_path, **overrides, aigw_endpoint=gateway.url, trainer_backend="scripted", min_samples_for_training=3,
            max_samples_per_run=5, lora_activation_timeout=3.0, training_tmp_root=str(tmp_path / "train-tmp"),
            training_policy={"auto": True, "min_pending_samples": 3, "poll_interval_seconds": 3600.0,
                             **(policy or {})})
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        return running_app(config, backend=backend), backend

    return factory


async def register(redis) -> None:
    """50 lineages registered, as their first Task starts would have done."""
    await redis.zadd(keys.LINEAGES, {name: 1.0 + i for i, name in enumerate(LINEAGES)})


async def run_tick(deps):
    [run] = await deps.scheduler.tick()
    return await wait_for_run(deps.runner, run.training_run_id)


async def test_of_fifty_lineages_the_three_with_samples_train_longest_waiting_first(app, redis):
    app_cm, backend = app()
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        mid = await publish(deps, "l23", 3, age_s=200)
        old = await publish(deps, "l07", 3, age_s=300)
        new = await publish(deps, "l41", 3, age_s=100)
        # Only the lines with pending samples are in the hint, each at its oldest sample: not the 47 others.
        assert await hint(redis) == {line(n): await head(redis, n) for n in ("l07", "l23", "l41")}

        order = []
        for ids in (old, mid, new):
            done = await run_tick(deps)
            order.append(done.lineage)
            # Each run claimed its own line's samples only, and produced the line's first version.
            assert backend.calls[-1]["sample_ids"] == ids
            assert (done.status, done.lora_name) == ("succeeded", f"{line(done.lineage)}:v1")
            assert (done.trigger["kind"], done.trigger["lineage"], done.trigger["reason"]) == (
                "auto", done.lineage, "min_pending_samples")
        assert order == ["l07", "l23", "l41"]
        assert await deps.scheduler.tick() == []  # nothing left anywhere
        assert await hint(redis) == {}  # every claimed-out line's entry was removed when read
        report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
        # Samples published without Task records (straight through the store); every other rule holds.
        assert [v for v in report.violations if "which has no record" not in v] == []


async def test_the_hint_is_raised_to_the_line_head_after_a_claim(app, redis):
    app_cm, backend = app()
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        ids = await publish(deps, "l05", 7, age_s=300)
        first_score = await head(redis, "l05")
        done = await run_tick(deps)
        assert backend.calls[-1]["sample_ids"] == ids[:5]  # max_samples_per_run: the 5 oldest
        # The claim left the entry low (still a lower bound) ...
        assert (await hint(redis))[line("l05")] == first_score < await head(redis, "l05")
        # ... and the next tick (2 left, below the threshold of 3) corrects it to the line's oldest pending sample.
        assert await deps.scheduler.tick() == []
        assert (await hint(redis))[line("l05")] == await head(redis, "l05")
        assert done.lineage == "l05"
        # An older sample becoming pending lowers the entry in the same EXEC (ZADD LT), here a late publication.
        more = await publish(deps, "l05", 1, age_s=400)
        assert (await hint(redis))[line("l05")] == await head(redis, "l05")
        assert (await redis.zrange(keys.traj_index(line("l05"), "pending"), 0, 0))[0].decode() == more[0]


async def test_a_paused_lineage_is_skipped_and_trains_once_resumed(app, redis):
    app_cm, backend = app()
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        await publish(deps, "l07", 3, age_s=300)
        younger = await publish(deps, "l23", 3, age_s=100)
        assert (await client.post("/v1/rl/lineages/l07/pause")).status_code == 200
        done = await run_tick(deps)
        assert (done.lineage, backend.calls[-1]["sample_ids"]) == ("l23", younger)
        assert await deps.scheduler.tick() == []  # only the paused line has samples
        assert line("l07") in await hint(redis)  # still waiting: paused is not forgotten
        assert (await client.post("/v1/rl/lineages/l07/resume")).status_code == 200
        assert (await run_tick(deps)).lineage == "l07"


async def test_lineage_overrides_apply_one_line_trains_at_two_the_others_at_eight(app, redis):
    app_cm, backend = app({"min_pending_samples": 8, "lineages": {"up": {"min_pending_samples": 2}}})
    async with app_cm as (application, client):
        deps = application.state.deps
        await redis.zadd(keys.LINEAGES, {"up": 1.0, "down": 2.0})
        await publish(deps, "down", 2, age_s=600)  # waited longer, but its threshold is the top level's 8
        up = await publish(deps, "up", 2, age_s=10)
        done = await run_tick(deps)
        assert (done.lineage, backend.calls[-1]["sample_ids"], done.sample_count) == ("up", up, 2)
        assert await deps.scheduler.tick() == []
        view = (await client.get("/v1/rl/lineages/down")).json()
        assert (view["scheduler"]["reason"], view["training_policy"]["min_pending_samples"]) == ("below_floor", 8)
        assert (await client.get("/v1/rl/lineages/up")).json()["training_policy"]["min_pending_samples"] == 2
        await publish(deps, "down", 6, age_s=5)
        assert (await run_tick(deps)).lineage == "down"


async def test_the_invariant_checker_flags_a_line_with_pending_samples_and_no_hint(app, redis):
    app_cm, _ = app({"auto": False})
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        await publish(deps, "l03", 1, age_s=10)

        async def violations() -> list[str]:
            report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
            return [v for v in report.violations if "which has no record" not in v]

        assert await violations() == []
        await redis.zadd(keys.TRAINING_WAITING, {line("l03"): await head(redis, "l03") + 1})  # above the oldest
        assert await violations() == [f"line {line('l03')} has pending samples but no waiting-hint at or before "
                                      "its oldest one"]
        await redis.zadd(keys.TRAINING_WAITING, {line("l03"): 0.0, line("zz"): 0.0})
        assert await violations() == [f"waiting-hint for {line('zz')!r}, which is not a registered lineage's line"]


async def test_a_lineage_whose_own_rollout_decides_waits_and_the_others_train(app, redis):
    """Each line rolls out its own versions: a live rollout of l07's line holds l07 only (the scheduler reads the
    default pointer and the live-lineage set, never every line)."""
    app_cm, backend = app()
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        await publish(deps, "l07", 3, age_s=300)
        younger = await publish(deps, "l23", 3, age_s=100)
        # l07's line has a rollout not ended, as the rollout store writes it (pointer and live set in one MULTI).
        async with redis.pipeline(transaction=True) as tx:
            tx.set(keys.rollout_current("l07"), "ro-l07")
            tx.sadd(keys.ROLLOUT_LIVE_LINEAGES, "l07")
            await tx.execute()
        assert await deps.rollout.live_lines() == {line("l07")}
        done = await run_tick(deps)
        assert (done.lineage, backend.calls[-1]["sample_ids"]) == ("l23", younger)
        assert await deps.scheduler.tick() == []  # l07 waits for its own rollout
        async with redis.pipeline(transaction=True) as tx:
            tx.delete(keys.rollout_current("l07"))
            tx.srem(keys.ROLLOUT_LIVE_LINEAGES, "l07")
            await tx.execute()
        assert (await run_tick(deps)).lineage == "l07"


async def test_a_line_whose_start_is_refused_gives_the_turn_to_the_next_in_the_same_tick(app, redis):
    """The longest-waiting line's claim is refused (as when its pending samples are stale for the claim, which the
    snapshot cannot see): the next eligible line starts in the same tick instead of every line waiting behind it."""
    from openjiuwen.agent_evolving.agent_rl.online.errors import Conflict

    app_cm, backend = app()
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        await publish(deps, "l07", 3, age_s=300)
        younger = await publish(deps, "l23", 3, age_s=100)
        real_start = deps.runner.start

        async def start(**kwargs):  # fault injection: l07's claim refused as the runner refuses a short batch
            if kwargs.get("lineage") == "l07":
                raise Conflict("pending samples 0 is below minimum 3", code="insufficient_samples")
            return await real_start(**kwargs)

        deps.runner.start = start
        done = await run_tick(deps)
        assert (done.lineage, backend.calls[-1]["sample_ids"]) == ("l23", younger)


async def test_a_line_whose_pending_samples_are_all_stale_never_blocks_the_others(app, redis, gateway):
    """Issue 27 review item 1: with `max_policy_lag: 1`, l07's 40 oldest pending samples were served by its v1
    while its active version is v3. Its claim counts them stale; the scheduler once counted every pending sample of
    a non-default line eligible, chose l07 every tick (it waited longest), its claim failed and the tick ended: no
    other line ever trained. Now a failed start falls through to the next line, and once l07's active version is
    observed its snapshot subtracts the stale samples as its claim does."""
    app_cm, backend = app(max_policy_lag=1)
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        gateway.line_active[line("l07")] = (f"{line('l07')}:v3", "/loras/l07/v3")
        await publish(deps, "l07", 40, age_s=600, policy=f"{line('l07')}:v1")
        fresh = await publish(deps, "l23", 3, age_s=100)
        done = await run_tick(deps)  # l07 first (longest wait) fails its claim; l23 starts in the same tick
        assert (done.lineage, backend.calls[-1]["sample_ids"]) == ("l23", fresh)
        # The failed start recorded l07's active version: its view counts the 40 stale, none eligible.
        view = (await client.get("/v1/rl/lineages/l07")).json()["scheduler"]
        assert (view["pending_samples"], view["eligible_samples"], view["eligible"]) == (40, 0, False)
        # Later ticks no longer try l07 at all: l23's new samples train next, l07 stays as it was.
        again = await publish(deps, "l23", 3, age_s=50)
        assert (await run_tick(deps)).lineage == "l23"
        assert backend.calls[-1]["sample_ids"] == again
        assert len(backend.calls) == 2
        assert await redis.zcard(keys.traj_index(line("l07"), "pending")) == 40
