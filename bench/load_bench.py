"""Sustained load of concurrent agent sessions through the reference gateway and its RL Service.

    .venv/bin/python bench/load_bench.py [--sessions 32] [--turns 4] [--duration 60] [--instances 2]
                                         [--workers auto] [--kill-workers 0]

Real processes: the gateway, its RL Service child (`--workers` worker processes) and a private redis-server;
`--instances` fake vLLM servers (recorded shapes, no model) and a fake Judge in this process. Each session loops:
signed Task start (a share in delayed-feedback mode), `--turns` chat completions (JSON or SSE), signed stop, signed
reward for terminal Tasks, until `--duration` has passed after a warm-up. `--kill-workers K` SIGKILLs K RL Service
workers at even intervals of the load (the worker group restarts each; captures in flight on them are repeated by
the gateway's hook retries). Prints requests, errors, latency percentiles, the RSS of the gateway and of the RL
Service (all its processes) after the warm-up and at the end, and the result of the Redis invariant checker
(tests/support/invariants.py); writes bench/results/load.json. Exits non-zero when a request failed, a completion
is not exactly one sample, or an invariant does not hold. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import write_result  # noqa: E402
from tests.support.fake_judge import FakeJudge  # noqa: E402
from tests.support.fake_vllm import FakeVLLM, Reply  # noqa: E402
from tests.support.gateway_process import API_KEY, GatewayProcess  # noqa: E402
from tests.support.invariants import check_invariants  # noqa: E402
from tests.support.load import LoadResult, LoadSpec, Pids, child_pid, run_load  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402
from tests.support.service_process import worker_pids  # noqa: E402

SERVICE_MODULE = "openjiuwen.agent_evolving.agent_rl.online.service"


async def _invariants(redis_url: str) -> dict:
    redis = Redis.from_url(redis_url)
    try:
        report = await check_invariants(redis, model_id="tiny", raise_on_violation=False)
    finally:
        await redis.aclose()
    return {**report.summary(), "violations": report.violations[:20]}


async def _kill_workers(group_pid: int, kills: int, spec: LoadSpec, seed: int) -> list[int]:
    """SIGKILL `kills` workers of the group at even intervals of the load, each once its predecessor is back."""
    rng, killed = random.Random(seed), []
    interval = spec.duration_s / (kills + 1)
    await asyncio.sleep(spec.warmup_s)
    for _ in range(kills):
        await asyncio.sleep(interval)
        workers = sorted(worker_pids(group_pid))
        if not workers:
            continue
        victim = rng.choice(workers)
        os.kill(victim, signal.SIGKILL)
        killed.append(victim)
    return killed


async def _load(url: str, spec: LoadSpec, pids: Pids, kills: int, seed: int) -> tuple[LoadResult, list[int]]:
    killer = asyncio.create_task(_kill_workers(pids.rl_service, kills, spec, seed)) if kills else None
    result = await run_load(url, spec, api_key=API_KEY, model_id="tiny", pids=pids)
    return result, (await killer if killer is not None else [])


def _print(result: LoadResult, invariants: dict, stats: dict, out: Path, workers: int, killed: list[int]) -> None:
    s = result.summary()
    print(f"load: {s['sessions']} sessions x {s['turns']} turns, {s['duration_s']} s "
          f"(warm-up {result.spec.warmup_s} s included), fake vLLM and Judge; RL Service with {workers} worker(s), "
          f"{len(killed)} SIGKILLed")
    print(f"  requests {s['requests']} ({s['requests_per_s']}/s), errors {s['errors']}, tasks {s['tasks']}, "
          f"completions {s['completions']}, samples stored {stats.get('total')}")
    print(f"  {'kind':<12} {'count':>7} {'p50 ms':>8} {'p99 ms':>8}")
    for kind, lat in s["latency_ms"].items():
        print(f"  {kind:<12} {s['requests_by_kind'].get(kind, 0):>7} {lat['p50']:>8.1f} {lat['p99']:>8.1f}")
    print(f"  {'process':<12} {'RSS before':>11} {'after':>8} {'growth':>8}  (MiB)")
    for name, rss in s["rss_mib"].items():
        print(f"  {name:<12} {rss['before']:>11.1f} {rss['after']:>8.1f} {rss['growth']:>8.1f}")
    print(f"  invariants: {'ok' if invariants['ok'] else 'VIOLATED'} "
          f"({invariants.get('keys')} keys, {invariants.get('samples')} samples, {invariants.get('tasks')} tasks)")
    for violation in invariants["violations"]:
        print(f"    {violation}")
    for error in result.errors[:10]:
        print(f"  error: {error}")
    print(f"  written to {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=32, help="concurrent agent sessions (default 32)")
    parser.add_argument("--turns", type=int, default=4, help="chat completions per Task (default 4)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load after the warm-up (60)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before the first RSS reading (5)")
    parser.add_argument("--instances", type=int, default=2, help="fake vLLM instances (default 2)")
    parser.add_argument("--delayed-share", type=float, default=0.25, help="share of delayed-feedback Tasks")
    parser.add_argument("--stream-share", type=float, default=0.5, help="share of SSE completions")
    parser.add_argument("--workers", default="auto", type=lambda v: v if v == "auto" else int(v),
                        help="RL Service worker processes (auto or a count; default auto)")
    parser.add_argument("--kill-workers", type=int, default=0,
                        help="SIGKILL this many RL Service workers during the load (needs --workers 2 or more)")
    parser.add_argument("--hook-timeout", default="30s", help="the gateway's hookTimeout (default 30s)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "load.json"))
    args = parser.parse_args()
    spec = LoadSpec(sessions=args.sessions, turns=args.turns, duration_s=args.duration, warmup_s=args.warmup,
                    delayed_share=args.delayed_share, stream_share=args.stream_share)
    with tempfile.TemporaryDirectory(prefix="rl-load-bench-") as tmp, ExitStack() as stack:
        redis_server = stack.enter_context(RedisServer(Path(tmp) / "redis"))
        judge = stack.enter_context(FakeJudge())
        vllms = [stack.enter_context(FakeVLLM(served_model="tiny", name=f"bench-vllm-{i}"))
                 for i in range(args.instances)]
        for v in vllms:
            v.reply = Reply(content="A short answer to the question.")
        gw = stack.enter_context(GatewayProcess(
            Path(tmp), redis_server.url, instances=vllms, judge_url=judge.url, rl_overrides={"workers": args.workers},
            online_overrides={"hookTimeout": args.hook_timeout, "drainTimeout": "30s"},
        ))
        gw.start_service()
        assert gw.proc is not None
        pids = Pids(gateway=gw.proc.pid, rl_service=child_pid(gw.proc.pid, SERVICE_MODULE))
        workers = len(worker_pids(pids.rl_service)) or 1
        result, killed = asyncio.run(_load(gw.url, spec, pids, args.kill_workers, spec.seed))
        stats = gw.signed("GET", "/v1/rl/trajectories/stats").json()
        invariants = asyncio.run(_invariants(redis_server.url))
        restarted = gw.rl_log().count("; restarting it in") if killed else 0
    out = write_result({**result.summary(), "samples_stored": stats.get("total"), "invariants": invariants,
                        "errors_sample": result.errors[:10], "workers": workers, "workers_killed": len(killed),
                        "workers_restarted": restarted}, args.out)
    _print(result, invariants, stats, out, workers, killed)
    consistent = stats.get("total") == result.completions
    return 0 if result.error_count == 0 and invariants["ok"] and consistent else 1


if __name__ == "__main__":
    sys.exit(main())
