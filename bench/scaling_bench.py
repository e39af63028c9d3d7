"""Scaling: claim of a 128-sample batch and trajectory stats with 10k, 100k and 1M pending samples, and the RL
Service's start-up recovery time with 10k active Tasks.

    .venv/bin/python bench/scaling_bench.py [--quick] [--sizes 10000 100000 1000000] [--active-tasks 10000]

A private redis-server; the store is seeded directly and pipelined in its stored layout (a bench, not a workload:
each seeded sample is a small valid hash). Claim = `RunClaims.claim` (the transaction behind `POST
/v1/rl/training/runs`), each followed by `finish(..., restore_samples=True)` so the pool keeps its size; stats =
`SampleStats.stats` (what `GET /v1/rl/trajectories/stats` returns). Recovery = the RL Service process from spawn to
`/health` 200 with N active Tasks in Redis (every one is aborted `service_restarted` before it serves), minus the same
with none. Prints a table, writes bench/results/scaling.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import percentile  # noqa: E402
from bench.machine import machine_facts, write_result  # noqa: E402
from tests.support.redis_server import RedisServer, free_port  # noqa: E402

MODEL = "bench-model"
T0 = 1_700_000_000.0

CLAIM_BATCH = 128  # samples per claimed run (a default Training Run's batch)


async def seed_samples(redis, store, start: int, stop: int) -> None:
    from openjiuwen.agent_evolving.agent_rl.online.store import keys
    from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample

    stats_key = keys.traj_stats(MODEL)
    batch = 5000
    for lo in range(start, stop, batch):
        hi = min(stop, lo + batch)
        async with redis.pipeline(transaction=False) as pipe:
            scores = {}
            for n in range(lo, hi):
                sid = f"s{n:08d}"
                created = f"2023-11-14T22:13:20.{n % 1_000_000:06d}+00:00"
                doc = {"sample_id": sid, "trajectory_id": sid, "source": "rl_task", "policy_version": "base",
                       "created_at": created, "trajectory": {"prompt_ids": [1, 2, 3], "response_ids": [4, 5],
                                                             "response_logprobs": [-0.5, -0.25]}}
                packed = PackedSample.from_document(doc)
                pipe.hset(keys.traj(sid), mapping={
                    "sample_id": sid, "user_id": MODEL, "session_id": "s", "rl_task_id": "t", "source": "rl_task",
                    "policy_version": "base", "created_at": created, "status": "pending", "updated_at": created,
                    "run_id": "", "sample_json": packed.meta_blob(), "prompt_ids": packed.prompt_ids,
                    "response_ids": packed.response_ids, "response_logprobs": packed.response_logprobs})
                scores[sid] = T0 + n
            pipe.zadd(store.line.index_key("pending"), scores)
            pipe.hincrby(stats_key, "status:pending", hi - lo)
            pipe.hincrby(stats_key, "source:rl_task", hi - lo)
            pipe.hincrby(stats_key, "pending_policy:base", hi - lo)
            await pipe.execute()


async def measure_store(redis_url: str, sizes: list[int], reps: int) -> list[dict]:
    from redis.asyncio import Redis

    from openjiuwen.agent_evolving.agent_rl.common.ids import now_iso
    from openjiuwen.agent_evolving.agent_rl.online.assembly import make_sample_store
    from openjiuwen.agent_evolving.agent_rl.online.training.run_records import (
        RunStage, RunStatus, TrainingRun, new_run_id,
    )
    from openjiuwen.agent_evolving.agent_rl.online.training.run_claims import RunClaims
    from openjiuwen.agent_evolving.agent_rl.online.training.run_transitions import RunTransitions
    from openjiuwen.agent_evolving.agent_rl.online.store.fence import UNFENCED

    redis = Redis.from_url(redis_url)
    store = make_sample_store(redis, model_id=MODEL)
    runs = RunTransitions(redis, store.line, model_id=MODEL, run_retention_s=3600, fence=UNFENCED)
    claims = RunClaims(redis, store.line, store.outdated, model_id=MODEL, fence=UNFENCED)
    rows = []
    seeded = 0
    try:
        for size in sizes:
            t0 = time.perf_counter()
            await seed_samples(redis, store, seeded, size)
            seed_s = time.perf_counter() - t0
            seeded = size
            claim_ms, stats_ms = [], []
            for _ in range(reps):
                draft = TrainingRun(training_run_id=new_run_id(), status=RunStatus.PENDING.value,
                                    stage=RunStage.QUEUED.value, sample_count=0, policy_versions={},
                                    created_at=now_iso())
                t0 = time.perf_counter()
                result = await claims.claim(draft, parent_version=0, max_policy_lag=None, min_samples=CLAIM_BATCH,
                                            max_samples=CLAIM_BATCH)
                claim_ms.append((time.perf_counter() - t0) * 1000)
                assert result.run is not None and result.run.sample_count == CLAIM_BATCH, result
                await runs.finish(result.run.training_run_id, RunStatus.CANCELED, restore_samples=True)
                t0 = time.perf_counter()
                stats = await store.stats.stats(store.line)
                stats_ms.append((time.perf_counter() - t0) * 1000)
                assert stats["by_status"]["pending"] == size, stats
            info = await redis.info("memory")
            rows.append({"pending": size, "seed_s": seed_s, "load_avg_1m": os.getloadavg()[0],
                         "claim128_ms": {"median": statistics.median(claim_ms), "p99": percentile(claim_ms, 99)},
                         "stats_ms": {"median": statistics.median(stats_ms), "p99": percentile(stats_ms, 99)},
                         "redis_used_memory_mb": info["used_memory"] / 2**20})
            r = rows[-1]
            print(f"  {size:>9} {r['claim128_ms']['median']:12.2f} {r['claim128_ms']['p99']:9.2f} "
                  f"{r['stats_ms']['median']:10.3f} {r['stats_ms']['p99']:9.3f} {seed_s:8.1f} "
                  f"{r['redis_used_memory_mb']:9.0f} {r['load_avg_1m']:5.2f}", flush=True)
    finally:
        await redis.aclose()
    return rows


async def seed_active_tasks(redis_url: str, n: int) -> None:
    from redis.asyncio import Redis

    from openjiuwen.agent_evolving.agent_rl.common.ids import now_iso
    from openjiuwen.agent_evolving.agent_rl.online.store import keys
    from openjiuwen.agent_evolving.agent_rl.online.tasks.task_records import Task

    redis = Redis.from_url(redis_url)
    try:
        at = now_iso()
        for lo in range(0, n, 2000):
            async with redis.pipeline(transaction=False) as pipe:
                for i in range(lo, min(n, lo + 2000)):
                    t, s = f"rt{i}", f"rs{i}"
                    task = Task(t, s, MODEL, "base", "terminal", "active", at, policy_model=MODEL)
                    pipe.set(keys.task(t), task.to_json())
                    pipe.set(keys.active_session(s), t)
                    pipe.sadd(keys.ACTIVE_TASKS, t)
                await pipe.execute()
    finally:
        await redis.aclose()


def time_to_ready(workdir: Path, redis_url: str) -> float:
    port = free_port()
    config = workdir / "rl.yaml"
    config.write_text(orjson.dumps({
        "listen_port": port, "redis_url": redis_url, "model_id": MODEL, "base_model_path": "/models/bench",
        "lora_repository_path": str(workdir / "loras"), "log_path": str(workdir / "rl-service.log"),
        "trainer_backend": "scripted", "aigw_endpoint": f"http://127.0.0.1:{free_port()}",
    }).decode())
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.online.service", "--config", str(config)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"RL Service exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise RuntimeError("RL Service not ready in 600 s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def count_aborted(redis_url: str) -> tuple[int, int]:
    from redis.asyncio import Redis

    from openjiuwen.agent_evolving.agent_rl.online.store import keys

    redis = Redis.from_url(redis_url)
    try:
        left = await redis.scard(keys.ACTIVE_TASKS)
        raw = await redis.get(keys.task("rt0"))
        return left, int(b'"service_restarted"' in (raw or b""))
    finally:
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10k and 100k pending samples, 2k active Tasks")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help=f"pending-sample counts to measure, each at least {CLAIM_BATCH} (one claim)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--active-tasks", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "scaling.json"))
    args = parser.parse_args()
    sizes = args.sizes or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    active = args.active_tasks if args.active_tasks is not None else (2_000 if args.quick else 10_000)
    with tempfile.TemporaryDirectory(prefix="rl-scaling-bench-") as tmp:
        work = Path(tmp)
        with RedisServer(work / "redis-samples") as redis_server:
            print(f"claim of {CLAIM_BATCH} and stats vs pending samples (ms)")
            print(f"  {'pending':>9} {'claim p50':>12} {'p99':>9} {'stats p50':>10} {'p99':>9} {'seed s':>8} "
                  f"{'redis MB':>9} {'load':>5}", flush=True)
            rows = asyncio.run(measure_store(redis_server.url, sizes, args.reps))
        with RedisServer(work / "redis-tasks") as redis_server:
            empty_s = time_to_ready(work, redis_server.url)
            asyncio.run(seed_active_tasks(redis_server.url, active))
            loaded_s = time_to_ready(work, redis_server.url)
            left, aborted = asyncio.run(count_aborted(redis_server.url))
            assert left == 0 and aborted == 1, (left, aborted)
    recovery = {"active_tasks": active, "ready_s_empty": empty_s, "ready_s_with_tasks": loaded_s,
                "recovery_s": loaded_s - empty_s, "tasks_per_s": active / max(1e-9, loaded_s - empty_s),
                "load_avg_1m": os.getloadavg()[0]}
    print(f"start-up recovery: {active} active Tasks aborted in {recovery['recovery_s']:.2f} s "
          f"({recovery['tasks_per_s']:.0f} Tasks/s; ready in {loaded_s:.2f} s vs {empty_s:.2f} s empty)")
    out = write_result({"machine": machine_facts(), "claim_batch": CLAIM_BATCH, "claim_and_stats": rows, "recovery": recovery}, args.out)
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
