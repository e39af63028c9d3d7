"""The RL Service under many lineages (issue 27 item 6, docs/lineages.md "## Capacity planning"): Redis bytes per
lineage, the automatic-training scheduler's tick, and the claim of a batch on the default line vs a lineage's line.

    .venv/bin/python bench/lineage_scale_bench.py [--quick] [--sizes 10 100 1000] [--pending-lines 64]
        [--samples 64] [--batches 8 64] [--reps 20] [--out FILE]

A private redis-server on a free port in a temp dir; nothing else runs. Lineages are registered as the start EXEC of
their first Task registers them (`ZADD rl:v1:lineages NX`); samples go in through `SamplePublisher.insert_if_absent`
(the publication path: hash, the line's pending index and counters, its due-index entry), each a small sample (3 prompt
and 2 response tokens). Measured:

- bytes: `MEMORY USAGE` of the per-line keys (the line's pending index and counters, its `rl:v1:lineages` member and
  due-index entry as a share of those ZSETs) and the `INFO used_memory` delta per registered lineage without
  samples, and per line that got `--samples` samples (which includes those samples' hashes);
- the scheduler's tick (`TrainingScheduler.tick`, automatic training on, a runner that starts nothing) at each of
  `--sizes` registered lineages, `min(--pending-lines, size)` of them with samples: wall time and the Redis commands
  it issued (INFO commandstats delta), once with none eligible (each line one sample short of
  `min_pending_samples`: after the warm-up tick judged them, a tick reads no line but the default one) and once with
  every line eligible (an eligible line stays due: each tick judges them all). The warm-up tick of each new scheduler
  judges every registered line once (what a leader's first tick does) and is not counted;
- the claim (`RunClaims.claim`, the transaction behind `POST /v1/rl/training/runs`) of `--batches` samples from the
  default line and from a lineage's line, each followed by `finish(..., restore_samples=True)` (not counted).

Commands exclude INFO and CLIENT (the measurement's own and redis-py's connection setup). Prints tables, writes JSON.
`--quick` (< 1 minute) is the full run with fewer repetitions; there is no target.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import percentile  # noqa: E402
from bench.machine import machine_facts, write_result  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

MODEL = "bench-model"
T0 = 1_700_000_000  # creation epoch of the first sample; every sample is older than the scheduler's clock
_NOT_COUNTED = {"cmdstat_info", "cmdstat_client"}


def lineage_name(i: int) -> str:
    return f"user-{i:06d}"


async def commands(redis) -> int:
    """Commands served so far, but the measurement's own INFO and redis-py's CLIENT SETINFO on a new connection."""
    stats = await redis.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k not in _NOT_COUNTED)


async def used_memory(redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


class _StartsNothing:
    """The runner the tick hands its choice to: nothing starts, so every tick judges the same state."""

    def __init__(self) -> None:
        self.chosen: list[str] = []

    async def start(self, *, trigger: dict[str, Any], min_samples: int, lineage: str) -> tuple[None, bool]:
        self.chosen.append(lineage)
        return None, False


def sample(lineage: str, n: int) -> Any:
    from openjiuwen.agent_evolving.agent_rl.common.lineage import DEFAULT_LINEAGE
    from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample

    sid = f"{lineage}-s{n:06d}"
    created = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(T0 + n)) + ".000000+00:00"
    doc = {"sample_id": sid, "trajectory_id": sid, "source": "rl_task", "policy_version": "base",
           "created_at": created, "session_id": "s", "rl_task_id": f"t-{lineage}",
           "trajectory": {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "response_logprobs": [-0.5, -0.25]}}
    if lineage != DEFAULT_LINEAGE:
        doc["lineage"] = lineage
    return PackedSample.from_document(doc)


async def register(redis, start: int, stop: int) -> None:
    """What the first Task of each lineage adds (tasks/registry.py), pipelined: a bench, not a workload."""
    from openjiuwen.agent_evolving.agent_rl.online.store import keys

    async with redis.pipeline(transaction=False) as pipe:
        for i in range(start, stop):
            pipe.zadd(keys.LINEAGES, {lineage_name(i): T0 + i}, nx=True)
        await pipe.execute()


async def line_key_bytes(redis, line: str, lineage: str) -> dict[str, int]:
    """MEMORY USAGE of a line's own keys, and its share of the two machine-wide ZSETs it has a member in."""
    from openjiuwen.agent_evolving.agent_rl.online.store import keys
    from openjiuwen.agent_evolving.agent_rl.online.store.sample_status import SampleStatus

    own = {"pending_index": keys.traj_index(line, SampleStatus.PENDING), "stats": keys.traj_stats(line)}
    out = {name: int(await redis.memory_usage(key, samples=0) or 0) for name, key in own.items()}
    for name, key in (("registry_share", keys.LINEAGES), ("waiting_share", keys.TRAINING_WAITING)):
        total, members = int(await redis.memory_usage(key, samples=0) or 0), await redis.zcard(key)
        out[name] = total // max(1, members)
    out["total"] = sum(out.values())
    assert await redis.zscore(keys.TRAINING_WAITING, line) is not None, "an eligible line has a due entry"
    return out


async def measure_tick(redis, scheduler, runner, reps: int) -> dict[str, Any]:
    await scheduler.tick()  # warm: pooled connections opened, every registered line judged once
    wall_ms, cmds = [], []
    for _ in range(reps):
        runner.chosen.clear()
        before = await commands(redis)
        t0 = time.perf_counter()
        await scheduler.tick()
        wall_ms.append((time.perf_counter() - t0) * 1000)
        cmds.append(await commands(redis) - before)
    return {"wall_ms": {"median": statistics.median(wall_ms), "p99": percentile(wall_ms, 99)},
            "commands": {"min": min(cmds), "max": max(cmds)}, "chosen": list(runner.chosen)}


async def measure_claims(redis, claims, runs, lineage: str, batches: list[int], reps: int) -> list[dict[str, Any]]:
    from openjiuwen.agent_evolving.agent_rl.common.ids import now_iso
    from openjiuwen.agent_evolving.agent_rl.online.training.run_records import (
        RunStage, RunStatus, TrainingRun, new_run_id,
    )

    rows = []
    for batch in batches:
        wall_ms, cmds = [], []
        for _ in range(reps):
            draft = TrainingRun(training_run_id=new_run_id(), status=RunStatus.PENDING.value,
                                stage=RunStage.QUEUED.value, sample_count=0, policy_versions={},
                                created_at=now_iso(), lineage=lineage)
            before = await commands(redis)
            t0 = time.perf_counter()
            result = await claims.claim(draft, parent_version=0, max_policy_lag=None, min_samples=batch,
                                        max_samples=batch)
            wall_ms.append((time.perf_counter() - t0) * 1000)
            cmds.append(await commands(redis) - before)
            assert result.run is not None and result.run.sample_count == batch, result
            await runs.finish(result.run.training_run_id, RunStatus.CANCELED, restore_samples=True)
        rows.append({"lineage": lineage, "batch": batch,
                     "wall_ms": {"median": statistics.median(wall_ms), "p99": percentile(wall_ms, 99)},
                     "commands": {"min": min(cmds), "max": max(cmds)}})
    return rows


async def run(redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    from redis.asyncio import Redis

    from openjiuwen.agent_evolving.agent_rl.common.lineage import DEFAULT_LINEAGE, line_of
    from openjiuwen.agent_evolving.agent_rl.online.assembly import make_sample_store
    from openjiuwen.agent_evolving.agent_rl.online.training.pauses import LineagePauses
    from openjiuwen.agent_evolving.agent_rl.online.training.training_policy import TrainingPolicyConfig
    from openjiuwen.agent_evolving.agent_rl.online.training.run_claims import RunClaims
    from openjiuwen.agent_evolving.agent_rl.online.training.run_reads import RunReads
    from openjiuwen.agent_evolving.agent_rl.online.training.run_transitions import RunTransitions
    from openjiuwen.agent_evolving.agent_rl.online.training.scheduler import TrainingScheduler
    from openjiuwen.agent_evolving.agent_rl.online.store.fence import UNFENCED

    redis = Redis.from_url(redis_url)
    store = make_sample_store(redis, model_id=MODEL)
    runs = RunTransitions(redis, store.line, model_id=MODEL, run_retention_s=3600, fence=UNFENCED)
    run_claims = RunClaims(redis, store.line, store.outdated, model_id=MODEL, fence=UNFENCED)
    runner = _StartsNothing()

    def scheduler(min_pending: int) -> TrainingScheduler:
        policy = TrainingPolicyConfig(auto=True, min_pending_samples=min_pending)
        return TrainingScheduler(redis, runs=RunReads(redis), runner=runner, line=store.line,  # type: ignore[arg-type]
                                 outdated=store.outdated, rollout=None,
                                 pauses=LineagePauses(redis, model_id=MODEL), fence=UNFENCED, policy=policy,
                                 model_id=MODEL,
                                 max_policy_lag=None, clock=lambda: float(T0 + 10 * args.samples))

    try:
        # The default line's samples first, so every tick below sees the same default line.
        await store.publisher.insert_if_absent([sample(DEFAULT_LINEAGE, n) for n in range(args.samples)])
        registered = with_samples = 0
        reg_bytes = sample_bytes = 0
        ticks = []
        for size in args.sizes:
            before = await used_memory(redis)
            await register(redis, registered, size)
            reg_bytes += await used_memory(redis) - before
            registered = size
            target = min(args.pending_lines, size)
            before = await used_memory(redis)
            for i in range(with_samples, target):
                name = lineage_name(i)
                await store.publisher.insert_if_absent([sample(name, n) for n in range(args.samples)])
            sample_bytes += await used_memory(redis) - before
            with_samples = target
            row: dict[str, Any] = {"registered": size, "lines_with_samples": target}
            # None eligible first: then the eligible lines stay due for the byte count below.
            for case, min_pending in (("none_eligible", args.samples + 1), ("eligible", args.samples)):
                row[case] = await measure_tick(redis, scheduler(min_pending), runner, args.reps)
            assert row["eligible"]["chosen"] and not row["none_eligible"]["chosen"], row
            ticks.append(row)
            e, n = row["eligible"], row["none_eligible"]
            print(f"  {size:>10} {target:>8} {e['wall_ms']['median']:9.2f} {e['commands']['max']:6} "
                  f"{n['wall_ms']['median']:9.2f} {n['commands']['max']:6}", flush=True)

        probe = lineage_name(0)
        line_bytes = await line_key_bytes(redis, line_of(MODEL, probe), probe)
        memory = {
            "registered": registered,
            "lines_with_samples": with_samples,
            "samples_per_line": args.samples,
            "used_memory_per_registered_lineage": reg_bytes / max(1, registered),
            "used_memory_per_line_with_samples": sample_bytes / max(1, with_samples),
            "used_memory_per_sample": sample_bytes / max(1, with_samples * args.samples),
            "line_keys_bytes": line_bytes,
        }
        print(f"bytes: {memory['used_memory_per_registered_lineage']:.0f} per registered lineage (used_memory), "
              f"{memory['used_memory_per_line_with_samples']:.0f} per line with {args.samples} samples "
              f"({memory['used_memory_per_sample']:.0f} per sample); the line's own keys "
              f"(MEMORY USAGE) {line_bytes}", flush=True)

        claims = []
        for lineage in (DEFAULT_LINEAGE, probe):
            claims += await measure_claims(redis, run_claims, runs, lineage, args.batches, args.reps)
        print(f"claim ({args.reps} reps): {'line':>12} {'batch':>6} {'p50 ms':>8} {'p99 ms':>8} {'cmds':>6}")
        for row in claims:
            print(f"  {row['lineage']:>23} {row['batch']:>6} {row['wall_ms']['median']:8.2f} "
                  f"{row['wall_ms']['p99']:8.2f} {row['commands']['max']:6}")
        return {"memory": memory, "ticks": ticks, "claims": claims, "load_avg_1m": os.getloadavg()[0]}
    finally:
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the full sizes with 5 repetitions (< 1 minute)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000],
                        help="registered lineages at each tick measurement, increasing (default 10 100 1000)")
    parser.add_argument("--pending-lines", type=int, default=64, help="lineages given samples (default 64)")
    parser.add_argument("--samples", type=int, default=64,
                        help="pending samples per line with samples, at least the largest batch (default 64)")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64], help="claimed batch sizes (default 8 64)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per measurement (default 20, quick 5)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "lineage_scale.json"))
    args = parser.parse_args()
    if args.sizes != sorted(args.sizes) or args.sizes[0] < 1:
        parser.error("--sizes must be positive and increasing")
    if args.samples < max(args.batches):
        parser.error("--samples must be at least the largest of --batches (a claim takes a full batch)")
    args.reps = args.reps or (5 if args.quick else 20)
    with tempfile.TemporaryDirectory(prefix="rl-lineage-scale-bench-") as tmp, \
            RedisServer(Path(tmp) / "redis") as redis_server:
        print("scheduler tick vs registered lineages")
        print(f"  {'registered':>10} {'w/ samp':>8} {'elig ms':>9} {'cmds':>6} {'none ms':>9} {'cmds':>6}", flush=True)
        result = asyncio.run(run(redis_server.url, args))
    result.update({"machine": machine_facts(), "sizes": args.sizes, "pending_lines": args.pending_lines,
                   "samples": args.samples, "batches": args.batches, "reps": args.reps})
    out = write_result(result, args.out)
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
