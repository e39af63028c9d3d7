"""Automatic training over lineages (docs/lineages.md, issue 27 item 3, issue 36 item 3) with real Redis, the
scripted trainer and a fake gateway on a real socket: the scheduler finds the lines to judge through the due index
(`rl:v1:training:waiting`), never by reading every registered lineage, drops the lines below their threshold until
a sample arrives, trains in fair-share order (never by backlog: the `flood`/`meek` case, weights, the runs-per-hour
quota), skips paused lineages, judges each line under its lineage's override, moves samples lagging their line's
policy to `outdated`, and finds an eligible line among 5,000 lineages below their threshold within one tick.

The scheduler's own loop is stopped once the app runs and each test calls `scheduler.tick()` itself.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.capture.response import validate_response
from openjiuwen.agent_evolving.agent_rl.online.capture.sample import build_sample
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.store import keys, prompt_blocks
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
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
        assert await deps.samples.publisher.insert_if_absent([sample]) == [f"c{i:05d}"]
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
            redis_url, tmp_path, **{"min_samples_for_training": 3, "max_samples_per_run": 5, **overrides},
            aigw_endpoint=gateway.url, trainer_backend="scripted", lora_activation_timeout=3.0,
            training_tmp_root=str(tmp_path / "train-tmp"),
            training_policy={"auto": True, "min_pending_samples": 3, "poll_interval_seconds": 3600.0,
                             **(policy or {})})
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        return manual_ticks(config, backend), backend

    return factory


@asynccontextmanager
async def manual_ticks(config, backend):
    """The app with its scheduler loop stopped (its first tick would race the test's publications)."""
    async with running_app(config, backend=backend) as (application, client):
        await application.state.deps.scheduler.stop()
        yield application, client


async def register(redis) -> None:
    """50 lineages registered, as their first Task starts would have done."""
    await redis.zadd(keys.LINEAGES, {name: 1.0 + i for i, name in enumerate(LINEAGES)})


async def run_tick(deps):
    [run] = await deps.scheduler.tick()
    return await wait_for_run(deps.runner, run.training_run_id)


async def test_of_fifty_lineages_the_three_with_samples_train_and_never_trained_lines_go_oldest_first(app, redis):
    app_cm, backend = app()
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        mid = await publish(deps, "l23", 3, age_s=200)
        old = await publish(deps, "l07", 3, age_s=300)
        new = await publish(deps, "l41", 3, age_s=100)
        # Only the lines with pending samples are due, each at its oldest sample: not the 47 others.
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
        assert order == ["l07", "l23", "l41"]  # equal shares (never trained): the longest wait breaks the tie
        assert await deps.scheduler.tick() == []  # nothing left anywhere
        assert await hint(redis) == {}  # every claimed-out line's entry was removed when judged
        report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
        # Samples published without Task records (straight through the store); every other rule holds.
        assert [v for v in report.violations if "which has no record" not in v] == []


async def test_a_line_below_its_threshold_leaves_the_due_index_until_a_sample_arrives(app, redis):
    app_cm, backend = app()
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        ids = await publish(deps, "l05", 7, age_s=300)
        done = await run_tick(deps)
        assert backend.calls[-1]["sample_ids"] == ids[:5]  # max_samples_per_run: the 5 oldest
        assert done.lineage == "l05"
        # 2 left, below the threshold of 3: the next tick judges the line once and drops it from the due index ...
        assert await deps.scheduler.tick() == []
        assert line("l05") not in await hint(redis)
        assert await deps.scheduler.due_lines(time.time()) == []  # ... so later ticks never read it
        # A publication makes it due again in its own EXEC (ZADD LT to the sample's creation), and it trains.
        more = await publish(deps, "l05", 1, age_s=400)
        assert (await hint(redis))[line("l05")] == await head(redis, "l05")
        assert (await redis.zrange(keys.traj_index(line("l05"), "pending"), 0, 0))[0].decode() == more[0]
        await run_tick(deps)
        assert backend.calls[-1]["sample_ids"] == more + ids[5:]


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
        assert line("l07") not in await hint(redis)  # judged paused: not read again while paused ...
        assert (await client.post("/v1/rl/lineages/l07/resume")).status_code == 200
        assert line("l07") in await hint(redis)  # ... the resume's EXEC makes it due again
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


async def test_the_invariant_checker_flags_a_line_that_could_become_eligible_but_is_not_due(app, redis):
    policy = {"auto": True, "min_pending_samples": 3}
    app_cm, _ = app({"auto": False})
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        await publish(deps, "l03", 3, age_s=10)
        await publish(deps, "l04", 1, age_s=10)

        async def violations() -> list[str]:
            report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False,
                                            training_policy=policy)
            return [v for v in report.violations if "which has no record" not in v]

        assert await violations() == []
        await redis.zrem(keys.TRAINING_WAITING, line("l03"), line("l04"))  # l04 is below its threshold: allowed
        assert await violations() == [f"line {line('l03')} has 3 pending sample(s) and could become eligible, but "
                                      "is not due"]
        await redis.zadd(keys.TRAINING_WAITING, {line("l03"): 0.0, line("zz"): 0.0})
        assert await violations() == [
            f"training due-index entry for {line('zz')!r}, which is not a registered lineage's line"]


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
    """Issue 27 review item 1, issue 36: with `max_policy_lag: 1`, l07's 40 oldest pending samples were served by
    its v1 while its active version is v3. Its claim would never take them; left pending they kept l07 first in
    line at every tick. Now its first start reads v3, the 40 become `outdated` (counted, never claimed), the claim
    finds too few, and l23 starts in the same tick; l07 is no longer judged until a sample arrives."""
    app_cm, backend = app(max_policy_lag=1)
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        gateway.line_active[line("l07")] = (f"{line('l07')}:v3", "/loras/l07/v3")
        stale = await publish(deps, "l07", 40, age_s=600, policy=f"{line('l07')}:v1")
        fresh = await publish(deps, "l23", 3, age_s=100)
        done = await run_tick(deps)  # l07 first (longest wait) fails its claim; l23 starts in the same tick
        assert (done.lineage, backend.calls[-1]["sample_ids"]) == ("l23", fresh)
        view = (await client.get("/v1/rl/lineages/l07")).json()["scheduler"]
        assert (view["pending_samples"], view["eligible_samples"], view["eligible"]) == (0, 0, False)
        stats = (await client.get("/v1/rl/trajectories/stats", params={"lineage": "l07"})).json()
        assert (stats["by_status"]["outdated"], stats["by_status"]["pending"]) == (40, 0)
        assert {s.decode() for s in await redis.zrange(keys.traj_index(line("l07"), "outdated"), 0, -1)} == set(stale)
        # Later ticks no longer try l07 at all: l23's new samples train next.
        again = await publish(deps, "l23", 3, age_s=50)
        assert (await run_tick(deps)).lineage == "l23"
        assert backend.calls[-1]["sample_ids"] == again
        assert len(backend.calls) == 2
        assert line("l07") not in await hint(redis)
        report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False,
                                        training_policy={"auto": True, "min_pending_samples": 3})
        assert [v for v in report.violations if "which has no record" not in v] == []


async def test_the_scheduler_moves_samples_lagging_the_observed_policy_to_outdated(app, redis, gateway):
    """The scheduler retires lagging samples of every line it judges, against the line's observed policy, with no
    run start: 5 samples of v1 under an observed v4 (`max_policy_lag` 2) leave `pending`; the v3 ones stay."""
    app_cm, backend = app(max_policy_lag=2, policy={"min_pending_samples": 8})
    async with app_cm as (application, client):
        deps = application.state.deps
        await register(redis)
        # l09's active policy as the service observed it (what a run start or a promotion writes).
        await redis.hset(keys.POLICY_OBSERVED_LINES, line("l09"),
                         orjson.dumps({"lora_name": f"{line('l09')}:v4", "lora_path": "/loras/l09/v4", "at": "x"}))
        old = await publish(deps, "l09", 5, age_s=900, policy=f"{line('l09')}:v1")
        kept = await publish(deps, "l09", 2, age_s=100, policy=f"{line('l09')}:v3")
        assert await deps.scheduler.tick() == []
        assert await redis.zrange(keys.traj_index(line("l09"), "pending"), 0, -1) == [k.encode() for k in kept]
        assert sorted(m.decode() for m in await redis.zrange(keys.traj_index(line("l09"), "outdated"), 0, -1)) \
            == sorted(old)
        assert backend.calls == []
        report = await check_invariants(redis, model_id=MODEL_ID, raise_on_violation=False)
        assert [v for v in report.violations if "which has no record" not in v] == []


# ------------------------------------------------------------------ fair share (issue 36 item 3)


async def test_a_flooding_lineage_cannot_hold_back_another_beyond_its_share(app, redis):
    """The issue's case: `flood` has 30 samples (runs of 2), `meek` becomes eligible with 2 after flood's second
    run. Longest-waiting-first trained flood's whole backlog first (14 runs); fair share starts meek's run next,
    while flood keeps taking every other turn."""
    app_cm, backend = app({"min_pending_samples": 2}, max_samples_per_run=2, min_samples_for_training=2)
    async with app_cm as (application, client):
        deps = application.state.deps
        await redis.zadd(keys.LINEAGES, {"flood": 1.0, "meek": 2.0})
        await publish(deps, "flood", 30, age_s=600)
        order = [(await run_tick(deps)).lineage for _ in range(2)]
        await publish(deps, "meek", 2, age_s=1)  # far younger than flood's backlog
        meek_at = len(order)
        for _ in range(4):
            order.append((await run_tick(deps)).lineage)
        assert order == ["flood", "flood", "meek", "flood", "flood", "flood"]
        assert order.index("meek") - meek_at <= 1  # within 2 runs of becoming eligible (here: the very next)
        meek = next(r for r in (await client.get("/v1/rl/training/runs", params={"lineage": "meek"})).json()["items"])
        assert meek["freshness"]["eligible_wait_seconds"] is not None


async def test_weights_share_runs_in_proportion_while_both_lines_stay_eligible(app, redis):
    app_cm, backend = app({"min_pending_samples": 1, "lineages": {"gold": {"weight": 2.0}}},
                          max_samples_per_run=1, min_samples_for_training=1)
    async with app_cm as (application, client):
        deps = application.state.deps
        await redis.zadd(keys.LINEAGES, {"gold": 1.0, "lead": 2.0})
        await publish(deps, "gold", 12, age_s=10)
        await publish(deps, "lead", 12, age_s=600)  # waited far longer: backlog age does not buy turns
        order = [(await run_tick(deps)).lineage for _ in range(9)]
        assert (order.count("gold"), order.count("lead")) == (6, 3)
        shares = {k.decode(): float(v) for k, v in (await redis.hgetall(keys.FAIR_SHARE)).items()}
        assert shares["gold"] == pytest.approx(shares["lead"], abs=1.0)


async def test_the_runs_per_hour_quota_holds_a_line_and_dates_its_next_turn(app, redis):
    app_cm, backend = app({"lineages": {"busy": {"max_runs_per_hour": 1}}})
    async with app_cm as (application, client):
        deps = application.state.deps
        await redis.zadd(keys.LINEAGES, {"busy": 1.0})
        await publish(deps, "busy", 6, age_s=60)
        first = await run_tick(deps)  # 5 of 6 (max_samples_per_run)
        await publish(deps, "busy", 3, age_s=30)
        assert await deps.scheduler.tick() == []  # 4 eligible, but the hour's one run is spent
        view = (await client.get("/v1/rl/lineages/busy")).json()["scheduler"]
        started = datetime.fromisoformat(first.created_at).timestamp()
        assert (view["reason"], view["runs_last_hour"]) == ("max_runs_per_hour", 1)
        assert datetime.fromisoformat(view["next_eligible_at"]).timestamp() == pytest.approx(started + 3600, abs=1e-3)
        # Not read again before then: its due entry is the quota's end.
        assert (await hint(redis))[line("busy")] == pytest.approx(started + 3600, abs=1e-3)


async def test_an_eligible_line_is_found_in_one_tick_among_5000_lineages_below_their_threshold(app, redis):
    """5,000 registered lineages, each with one pending sample under a threshold of 3 (a key without a lineage limit
    can make these): the first tick judges every one once (the leader's start makes every registered line due) and
    drops them from the due index; then `meek` reaches its threshold and the very next tick starts it, reading only
    the lines due (here, meek's)."""
    app_cm, backend = app()
    async with app_cm as (application, client):
        deps = application.state.deps
        junk = [f"j{i:04d}" for i in range(5000)]
        await redis.zadd(keys.LINEAGES, {name: 1.0 + i for i, name in enumerate([*junk, "meek"])})
        await publish_one_each(deps, junk)
        assert await redis.zcard(keys.TRAINING_WAITING) == 5000
        assert await deps.scheduler.tick() == []
        assert await redis.zcard(keys.TRAINING_WAITING) == 0  # every junk line judged below its floor, dropped
        ids = await publish(deps, "meek", 3, age_s=1)
        assert await deps.scheduler.due_lines(time.time()) == [(line("meek"), "meek")]
        done = await run_tick(deps)
        assert (done.lineage, backend.calls[-1]["sample_ids"]) == ("meek", ids)


async def publish_one_each(deps, lineages: list[str]) -> None:
    """One pending sample per lineage, each queued by the store's own insertion code (`_queue_insert`: hash, index,
    counters, due entry) and 500 lineages per MULTI: 5,000 separate publications would take most of this test."""
    redis = deps.redis
    template = await sample_of("seed")
    now = datetime.now(UTC).isoformat()
    for start in range(0, len(lineages), 500):
        async with redis.pipeline(transaction=True) as tx:
            acquired: dict[bytes, tuple[bytes, int]] = {}
            for lineage in lineages[start:start + 500]:
                sample = PackedSample(dict(template.meta, sample_id=f"one-{lineage}", lineage=lineage),
                                      template.prompt_ids, template.response_ids, template.response_logprobs)
                split = prompt_blocks.split_prompt(sample.prompt_ids)
                for digest, block in split[0]:
                    acquired[digest] = (block, acquired.get(digest, (block, 0))[1] + 1)
                line = deps.samples.line.for_lineage(lineage)
                deps.samples.publisher._queue_insert(  # noqa: SLF001 - batched set-up
                    tx, line, sample, split, excluded=set(), now=now, now_epoch=datetime.fromisoformat(now).timestamp())
                tx.sadd(keys.TRAJ_USERS, line.owner)
            prompt_blocks.queue_acquire(tx, acquired)
            await tx.execute()


async def sample_of(lineage: str) -> PackedSample:
    i = next(_counter)
    task = Task(f"t{i}", f"s{i}", MODEL_ID, "base", "terminal", "finalized", "2026-01-01T00:00:00+00:00",
                lineage=lineage)
    sample = build_sample(task, capture_id=f"c{i:05d}", agent_turn_id=None, request=REQUEST, response=RESPONSE,
                          validated=validate_response(RESPONSE, policy_model=MODEL_ID))
    sample.meta["created_at"] = datetime.fromtimestamp(time.time() - 5, UTC).isoformat()
    sample.meta["judge"] = {"score": 1.0, "source": "terminal"}
    return sample
