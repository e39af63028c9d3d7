"""A bounded load through the real gateway and RL Service (issue 7: load): concurrent agent sessions × turns against
two fake vLLM instances for a fixed time, with zero errors, bounded RSS growth of both processes, every acknowledged
completion stored as exactly one sample, and the Redis invariants (tests/support/invariants.py) at the end.

The longer variant with a table and JSON output is bench/load_bench.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from tests.support.fake_judge import FakeJudge
from tests.support.fake_vllm import FakeVLLM, Reply
from tests.support.gateway_process import API_KEY, GatewayProcess
from tests.support.invariants import check_invariants
from tests.support.load import LoadSpec, Pids, child_pid, run_load

pytestmark = pytest.mark.system

SPEC = LoadSpec(sessions=8, turns=3, duration_s=12.0, warmup_s=3.0)
# Generous: the point is "no leak proportional to traffic", not a tight memory budget (bench/load_bench.py prints
# the real numbers). Python's allocator keeps arenas it has grown into, so a flat bound per process is the check.
RSS_GROWTH_LIMIT_MIB = 64.0
SERVICE_MODULE = "openjiuwen.agent_evolving.agent_rl.online.service"


@pytest.fixture
def vllms() -> Iterator[list[FakeVLLM]]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as a, FakeVLLM(served_model="tiny", name="vllm-b") as b:
        for v in (a, b):
            v.reply = Reply(content="A short answer to the question.")
        yield [a, b]


async def test_sessions_times_turns_without_errors_or_leaks(redis: Redis, redis_url, tmp_path, vllms) -> None:
    with FakeJudge() as judge, GatewayProcess(tmp_path, redis_url, instances=vllms, judge_url=judge.url) as gw:
        gw.start_service()
        assert gw.proc is not None
        pids = Pids(gateway=gw.proc.pid, rl_service=child_pid(gw.proc.pid, SERVICE_MODULE))
        result = await run_load(gw.url, SPEC, api_key=API_KEY, model_id="tiny", pids=pids)
        summary = result.summary()
        print("load:", summary)  # shown with -s; the numbers behind docs/reliability.md "## Load"

        assert result.error_count == 0, result.errors[:10]
        # Every agent finished at least one Task; with the fixed seed the first Tasks include delayed-feedback ones.
        assert sum(result.tasks.values()) >= SPEC.sessions and result.tasks["delayed_feedback"] >= 1, summary
        assert result.acknowledged_samples == result.tasks["terminal"] * SPEC.turns
        # Both instances served traffic (captured completions are spread over the instances holding the policy).
        assert all(v.count("/v1/chat/completions") > 0 for v in vllms)
        for process in ("gateway", "rl_service"):
            assert result.rss_growth_mib(process) < RSS_GROWTH_LIMIT_MIB, summary

        # Every completion of every finished Task is exactly one stored sample (terminal: rewarded; delayed: its
        # turns published by the next turn and by stop), and nothing else was stored.
        stats = gw.signed("GET", "/v1/rl/trajectories/stats").json()
        assert stats["total"] == result.completions, (stats, summary)
        assert stats["by_status"]["pending"] == result.completions
        active = gw.signed("GET", "/v1/rl/service").json()
        assert active["status"] == "running"

    report = await check_invariants(redis, model_id="tiny")
    assert report.ok, report.describe()
    assert report.samples == result.completions
