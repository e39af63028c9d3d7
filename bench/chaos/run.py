"""Chaos sweep: every fault scenario × N seeds against the RL Service as a real process, then the invariant checker.

    .venv/bin/python bench/chaos/run.py [--seeds 3] [--first-seed 1] [--scenario crash:run.marked ...]
                                        [--rounds 2] [--terminal-tasks 3] [--delayed-tasks 1]
                                        [--json | --out bench/results/chaos.json]

Scenarios (tests/support/chaos.py): `crash:<point>` for each fault injection point of online/faults.py (the service
exits there, is restarted without the fault and the workload resumes), `kill:random` (3 SIGKILLs at seeded
moments), `redis:pause` (Redis SIGSTOPped 2.5 s during captures and during a run claim), `redis:restart` (Redis
stopped and started again mid-traffic, AOF on), and against a group of 3 workers `wcrash:<point>` (a worker exits
at the point, the group restarts it), `kill:worker` and `kill:leader` (SIGKILLs of single workers). Each run owns a
private redis-server, fake gateway and Judge and the scripted trainer, all on loopback. Prints a table (scenario ×
seed → outcome) and totals, writes the JSON (`--json`, or `--out` as the other benches name it), and exits non-zero
when any run broke an invariant. `tests/system/test_chaos.py` runs a fast subset in `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import write_result  # noqa: E402
from tests.support.chaos import SCENARIOS, WORKER_KINDS, ChaosOutcome, Workload, run_scenario  # noqa: E402


def _row(o: ChaosOutcome) -> str:
    errors = ",".join(f"{k}={v}" for k, v in sorted(o.errors.items())) or "-"
    verdict = "ok" if o.ok else f"FAIL({len(o.violations)})"
    return (f"{o.scenario:<24} {o.seed:>4} {verdict:<9} {o.kills:>5} {o.redis_faults:>6} {o.tasks_started:>6} "
            f"{o.tasks_abandoned:>6} {o.runs_succeeded:>4} {o.samples:>7} {o.samples_checked:>7} "
            f"{o.max_error_latency_s:>7.2f} {o.duration_s:>6.1f}  {errors}")


async def sweep(args: argparse.Namespace) -> list[ChaosOutcome]:
    outcomes: list[ChaosOutcome] = []
    print(f"{'scenario':<24} {'seed':>4} {'outcome':<9} {'kills':>5} {'redisF':>6} {'tasks':>6} {'redone':>6} "
          f"{'runs':>4} {'samples':>7} {'checked':>7} {'maxErrS':>7} {'secs':>6}  errors seen by the client")
    workload = Workload(rounds=args.rounds, terminal_tasks=args.terminal_tasks, delayed_tasks=args.delayed_tasks)
    with tempfile.TemporaryDirectory(prefix="chaos-bench-") as tmp:
        for scenario in args.scenario or SCENARIOS:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                workdir = Path(tmp) / f"{scenario.replace(':', '_')}-{seed}"
                try:
                    outcome = await run_scenario(scenario, seed, workdir, workload)
                except Exception as exc:  # a harness or process failure is a failed run, not the end of the sweep
                    outcome = ChaosOutcome(scenario, seed, violations=[f"harness: {type(exc).__name__}: {exc}"])
                outcomes.append(outcome)
                print(_row(outcome), flush=True)
                for violation in outcome.violations[:10]:
                    print(f"    ! {violation}", flush=True)
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per scenario (default 3)")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="repeatable; default: all")
    parser.add_argument("--rounds", type=int, default=2, help="workload rounds per run (default 2)")
    parser.add_argument("--terminal-tasks", type=int, default=3, help="concurrent terminal Tasks per round (3)")
    parser.add_argument("--delayed-tasks", type=int, default=1, help="concurrent delayed-feedback Tasks per round (1)")
    parser.add_argument("--json", "--out", dest="json", type=Path, default=ROOT / "bench" / "results" / "chaos.json",
                        help="the result file (default bench/results/chaos.json)")
    args = parser.parse_args()
    began = time.monotonic()
    outcomes = asyncio.run(sweep(args))
    errors: Counter[str] = Counter()
    for o in outcomes:
        errors.update(o.errors)
    totals = {
        "runs": len(outcomes), "failed_runs": sum(not o.ok for o in outcomes),
        "scenarios": len({o.scenario for o in outcomes}), "kills": sum(o.kills for o in outcomes),
        # A worker of a worker group (wcrash:, kill:worker, kill:leader) dies alone; the others kill the service.
        "worker_kills": sum(o.kills for o in outcomes if o.scenario.startswith(WORKER_KINDS)),
        "redis_faults": sum(o.redis_faults for o in outcomes), "tasks_started": sum(o.tasks_started for o in outcomes),
        "tasks_redone": sum(o.tasks_abandoned for o in outcomes), "samples": sum(o.samples for o in outcomes),
        "samples_checked": sum(o.samples_checked for o in outcomes),
        "max_error_latency_s": max((o.max_error_latency_s for o in outcomes), default=0.0),
        "client_errors": dict(errors), "wall_s": round(time.monotonic() - began, 1),
    }
    print("\ntotals: " + ", ".join(f"{k}={v}" for k, v in totals.items()))
    write_result({"totals": totals, "runs": [o.as_json() for o in outcomes]}, args.json)
    print(f"wrote {args.json}")
    return 1 if totals["failed_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
