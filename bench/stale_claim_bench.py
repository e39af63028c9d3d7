"""What stale pending samples cost a claim (issue 37, suspected "stale backlogs"; docs/reliability.md): samples that lag
their line's policy past `max_policy_lag` stay in the line's pending index, the oldest first, and the claim behind
`POST /v1/rl/training/runs` (`RunClaims.claim`) reads one hash per stale sample before it finds its batch, under a
WATCH of that index. A flooder that keeps publishing to the line touches the index and aborts the claim's EXEC, and
every retry reads the stale samples again.

    .venv/bin/python bench/stale_claim_bench.py [--quick] [--stale 0 1000 10000] [--batch 8] [--reps 10] [--out F]

A private redis-server on a free port in a temp dir. One lineage's line gets `--stale` samples of policy `base` (the
oldest) and `--batch` samples of its current version v5; the claim runs with parent version 5 and `max_policy_lag`
1, so every `base` sample is stale. Measured per claim: wall time, Redis commands (INFO commandstats delta, INFO and
CLIENT left out), HGETs, and transaction attempts; then the same claim while a flooder publishes one more sample to
the line every `--flood-ms`, with the EXECs that WATCH aborted. Then both again as a run start makes them since issue
36 item 3 (`retired` in the JSON): `RunClaims.retire_outdated` first (the line's lagging samples become `outdated`),
then the claim; the time and commands count both. Prints a table, writes JSON. No target.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lineage_scale_bench import commands  # noqa: E402
from bench.machine import machine_facts, write_result  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

MODEL = "bench-model"
LINEAGE = "flood"
LINE = f"{MODEL}:{LINEAGE}"
T0 = 1_700_000_000
CURRENT = 5
LAG = 1


def sample(n: int, policy: str) -> Any:
    from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample

    sid = f"s{n:07d}"
    created = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(T0 + n)) + ".000000+00:00"
    return PackedSample.from_document({
        "sample_id": sid, "trajectory_id": sid, "source": "rl_task", "policy_version": policy, "created_at": created,
        "session_id": "s", "rl_task_id": "t-flood", "lineage": LINEAGE,
        "trajectory": {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "response_logprobs": [-0.5, -0.25]}})


async def publish(store, start: int, count: int, policy: str) -> None:
    for offset in range(0, count, 500):
        await store.insert_if_absent([sample(start + n, policy) for n in range(offset, min(count, offset + 500))])


async def hgets(redis) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_hget", {}).get("calls", 0))


async def one_claim(redis, claims, runs, batch: int, attempts: list[int], *, retire: bool = False) -> dict[str, Any]:
    from openjiuwen.agent_evolving.agent_rl.common.ids import now_iso
    from openjiuwen.agent_evolving.agent_rl.online.store.tx import RedisContention
    from openjiuwen.agent_evolving.agent_rl.online.training.run_records import (
        RunStage, RunStatus, TrainingRun, new_run_id,
    )

    draft = TrainingRun(training_run_id=new_run_id(), status=RunStatus.PENDING.value, stage=RunStage.QUEUED.value,
                        sample_count=0, policy_versions={}, created_at=now_iso(), lineage=LINEAGE)
    attempts.clear()
    before, hget_before = await commands(redis), await hgets(redis)
    t0 = time.perf_counter()
    try:
        if retire:  # what `TrainingRunner.start` does before its claim since issue 36
            await claims.retire_outdated(LINE, current_version=CURRENT, max_policy_lag=LAG)
        result = await claims.claim(draft, parent_version=CURRENT, max_policy_lag=LAG, min_samples=batch,
                                    max_samples=batch)
    except RedisContention:  # every attempt lost its WATCH: the run would not start (503 at the route)
        result = None
    wall_ms = (time.perf_counter() - t0) * 1000
    row = {"wall_ms": wall_ms, "commands": await commands(redis) - before,
           "hgets": await hgets(redis) - hget_before, "attempts": len(attempts), "claimed": result is not None}
    if result is not None:
        assert result.run is not None and result.run.sample_count == batch, result
        await runs.finish(result.run.training_run_id, RunStatus.CANCELED, restore_samples=True)
    return row


async def flood(store, start: int, every_s: float, stop: asyncio.Event) -> int:
    """One more sample on the line every `every_s` until `stop`: what an agent publishing fast does to the index."""
    n = 0
    while not stop.is_set():
        await store.insert_if_absent([sample(start + n, "base")])
        n += 1
        await asyncio.sleep(every_s)
    return n


async def run(redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    from redis.asyncio import Redis

    from openjiuwen.agent_evolving.agent_rl.online.assembly import make_sample_store
    from openjiuwen.agent_evolving.agent_rl.online.training.run_claims import RunClaims
    from openjiuwen.agent_evolving.agent_rl.online.training.run_transitions import RunTransitions
    from openjiuwen.agent_evolving.agent_rl.online.store.fence import UNFENCED

    redis = Redis.from_url(redis_url)
    rows = []
    try:
        for stale in args.stale:
            await redis.flushdb()  # the bench's own private server
            samples = make_sample_store(redis, model_id=MODEL)
            store = samples.publisher  # every sample names LINEAGE: published on its line
            claims = RunClaims(redis, samples.line, samples.outdated, model_id=MODEL, fence=UNFENCED)
            runs = RunTransitions(redis, samples.line, model_id=MODEL, run_retention_s=3600, fence=UNFENCED)
            attempts: list[int] = []
            scan = claims._oldest_eligible  # noqa: SLF001 - counted, not changed: one call per transaction attempt

            async def counted(*a: Any, **k: Any) -> Any:
                attempts.append(1)
                return await scan(*a, **k)

            claims._oldest_eligible = counted  # noqa: SLF001
            await publish(store, 0, stale, "base")
            await publish(store, stale, args.batch, f"{LINE}:v{CURRENT}")
            await one_claim(redis, claims, runs, args.batch, attempts)  # warm: pooled connections open
            row: dict[str, Any] = {"stale": stale, "batch": args.batch}
            for retire in (False, True):
                part = await measure(redis, claims, runs, store, args, attempts, retire=retire)
                if retire:
                    row["retired"] = part
                else:
                    row.update(part)
                q, f = part["quiet"], part["flooded"]
                print(f"  {stale:>7} {'yes' if retire else 'no':>7} {q['wall_ms']:>9.1f} {q['commands']:>8} "
                      f"{q['hgets']:>7} {f['wall_ms']:>10.1f} {f['attempts']:>9.1f} {f['hgets']:>8} "
                      f"{f['claimed']:>4}/{f['tries']}", flush=True)
            rows.append(row)
    finally:
        await redis.aclose()
    return {"rows": rows}


async def measure(redis, claims, runs, store, args: argparse.Namespace, attempts: list[int], *,
                  retire: bool) -> dict[str, Any]:
    """The claims quiet, then under the flooder (`retire`: each after `retire_outdated`, as a run start does)."""
    quiet = [await one_claim(redis, claims, runs, args.batch, attempts, retire=retire) for _ in range(args.reps)]
    stop = asyncio.Event()
    flooder = asyncio.create_task(flood(store, 10_000_000 * (1 + retire), args.flood_ms / 1000, stop))
    exec_before = int((await redis.info("commandstats")).get("cmdstat_exec", {}).get("calls", 0))
    flooded = [await one_claim(redis, claims, runs, args.batch, attempts, retire=retire) for _ in range(args.reps)]
    stop.set()
    published = await flooder
    execs = int((await redis.info("commandstats")).get("cmdstat_exec", {}).get("calls", 0)) - exec_before
    return {"quiet": summary(quiet), "flooded": summary(flooded), "flood_samples": published, "flood_execs": execs}


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {"wall_ms": statistics.median(r["wall_ms"] for r in rows),
            "commands": int(statistics.median(r["commands"] for r in rows)),
            "hgets": int(statistics.median(r["hgets"] for r in rows)),
            "attempts": statistics.mean(r["attempts"] for r in rows),
            "claimed": sum(r["claimed"] for r in rows), "tries": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="stale 0 and 1000, 3 repetitions (seconds)")
    parser.add_argument("--stale", type=int, nargs="+", default=[0, 1000, 10_000], help="stale samples per run")
    parser.add_argument("--batch", type=int, default=8, help="claimed batch (default 8)")
    parser.add_argument("--reps", type=int, default=None, help="claims per measurement (default 10, quick 3)")
    parser.add_argument("--flood-ms", type=float, default=2.0, help="the flooder's pause between samples (2 ms)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "stale_claim.json"))
    args = parser.parse_args()
    if args.quick:
        args.stale, args.reps = [0, 1000], args.reps or 3
    args.reps = args.reps or 10
    with tempfile.TemporaryDirectory(prefix="rl-stale-claim-bench-") as tmp, \
            RedisServer(Path(tmp) / "redis") as redis_server:
        print(f"claim of {args.batch} behind stale samples (max_policy_lag {LAG}); flooder every {args.flood_ms} ms")
        print(f"  {'stale':>7} {'retire':>7} {'quiet ms':>9} {'commands':>8} {'hgets':>7} {'flooded ms':>10} "
              f"{'attempts':>9} {'hgets':>8} {'claimed':>7}", flush=True)
        result = asyncio.run(run(redis_server.url, args))
    result.update({"machine": machine_facts(), "batch": args.batch, "reps": args.reps, "flood_ms": args.flood_ms,
                   "max_policy_lag": LAG})
    out = write_result(result, args.out)
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
