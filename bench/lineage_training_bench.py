"""Many lineages eligible at once: time until all are trained, freshness, CPU and memory (issue 36 item 6).

    .venv/bin/python bench/lineage_training_bench.py [--model tiny|smollm2] [--sizes 1 8 64] [--samples 8]
        [--modes per-run warm warm-k] [--k 8] [--quick] [--out bench/results/lineage_training.json]

For each size N and mode, one RL Service (in this process: the real scheduler, runner, local backend and LoRA
repository; real Redis; a fake gateway that activates every version) starts with N registered lineages, each with
`--samples` pending samples drawn from the model, and automatic training (threshold `--samples`). The clock runs from
the service's start until every lineage has a succeeded run whose version is active. Modes, all in the same run:

- `per-run`: today's default, one Training Run at a time (`max_concurrent_runs` 1), a fresh trainer process per run;
- `warm`:    `local.warm_trainer`, one run at a time: the base model is loaded once;
- `warm-k`:  `local.warm_trainer` with `max_concurrent_runs` = `max_runs_per_step` = K: K lineages train together.

Per mode: wall time, runs/s, freshness p50/p95 over the runs (each record's `sample_to_policy_seconds` p50 and the
eligible-to-run wait), CPU seconds (this process and its trainers) and the peak RSS of the process tree; and where one
lineage's run spends its time (N = 1): claim → training start, interpreter start-up (measured apart: a fresh
`python -c "import torch, transformers, peft"`), model load and PPO preparation, the PPO steps, writing and
publishing the version, activation. The goal of the issue: wall(64) <= one start-up + 1.25 x 64 x the step time of
one lineage's batch. `--quick`: the tiny model, 2 lineages of 4 short samples, per-run and warm-k (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_facts, write_result  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

MODEL_ID = "tiny"
MODES = ("per-run", "warm", "warm-k")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class TreeSampler:
    """Peak RSS of this process and its descendants (the trainers), sampled every 0.1 s in a thread."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self.peak_mib = 0.0
        self.peak_child_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = child = 0
            try:
                total = self._me.memory_info().rss
                for proc in self._me.children(recursive=True):
                    try:
                        if "redis-server" in " ".join(proc.cmdline()):
                            continue  # Redis is the bench's, not the trainer's
                        rss = proc.memory_info().rss
                        total += rss
                        child = max(child, rss)
                    except psutil.Error:
                        pass
            except psutil.Error:
                pass
            self.peak_mib = max(self.peak_mib, total / 2**20)
            self.peak_child_mib = max(self.peak_child_mib, child / 2**20)
            self._stop.wait(0.1)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def cpu_seconds() -> float:
    """CPU of this process and of its children already reaped (every trainer is, once its service has stopped)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def startup_seconds() -> float:
    """A fresh interpreter importing what a trainer process imports before it loads a model."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers, peft"], check=True)
    return time.perf_counter() - started


def make_pool(model_dir: Path, count: int, prompt_tokens: int, response_tokens: int) -> tuple[list[int], list, list]:
    """`count` responses drawn from the model at temperature 1, with their logprobs: every lineage trains these."""
    from tests.support import learning as L

    base = L.load_model(model_dir)
    prompt = (L.prompt_ids(model_dir) * (prompt_tokens // 4 + 1))[:prompt_tokens]
    responses = L.sample_responses_cached(base, prompt, count, response_tokens, seed=0)
    logprobs = L.batch_logprobs(base, prompt, responses)
    return prompt, responses, logprobs


def lineage_docs(name: str, pool: tuple[list[int], list, list], samples: int) -> list[dict[str, Any]]:
    from tests.support import learning as L

    prompt, responses, logprobs = pool
    now = datetime.now(UTC).isoformat()
    docs = L.documents(prompt, responses[:samples], logprobs[:samples], [float(i % 2) for i in range(samples)],
                       MODEL_ID)
    return [dict(d, sample_id=f"{name}-{i}", trajectory_id=f"{name}-{i}", rl_task_id=f"{name}-t{i}",
                 lineage=name, created_at=now) for i, d in enumerate(docs)]


class Timed:
    """Wraps the backend: when each run's `train` started and ended, and how long its trainer process part took
    (`_run_worker`: start-up, load, steps, adapter write); the rest of `train` is its input files and `publish`."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.calls: dict[str, dict[str, float]] = {}
        worker = backend._run_worker

        async def timed_worker(run_id: str, spec_path: Path, on_progress: Any) -> dict[str, Any]:
            started = time.perf_counter()
            try:
                return await worker(run_id, spec_path, on_progress)
            finally:
                self.calls.setdefault(run_id, {})["worker_s"] = time.perf_counter() - started

        backend._run_worker = timed_worker
        train = backend.train

        async def timed_train(job: Any, *, on_progress: Any) -> Any:
            started = time.perf_counter()
            try:
                return await train(job, on_progress=on_progress)
            finally:
                rec = self.calls.setdefault(job.training_run_id, {})
                rec.update(train_start=started, train_end=time.perf_counter(), train_s=time.perf_counter() - started)

        backend.train = timed_train


def iso_epoch(text: str | None) -> float | None:
    return datetime.fromisoformat(text).timestamp() if text else None


async def run_case(redis_url: str, tmp: Path, model_dir: Path, pool: Any, *, size: int, mode: str, k: int,
                   samples: int, ppo_yaml: Path) -> dict[str, Any]:
    from redis.asyncio import Redis

    from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
    from openjiuwen.agent_evolving.agent_rl.online.store import keys
    from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
    from openjiuwen.agent_evolving.agent_rl.online.assembly import make_backend
    from tests.support.fake_gateway import FakeGateway
    from tests.support.service_app import make_config, running_app

    redis = Redis.from_url(redis_url)
    await redis.flushdb()
    case_dir = Path(tempfile.mkdtemp(prefix=f"{mode}-{size}-", dir=tmp))
    concurrent = k if mode == "warm-k" else 1
    names = [f"l{i:03d}" for i in range(size)]
    await redis.zadd(keys.LINEAGES, {name: float(i) for i, name in enumerate(names)})
    async with FakeGateway(model_id=MODEL_ID) as gateway:
        config = make_config(
            redis_url, case_dir, aigw_endpoint=gateway.url, trainer_backend="local", base_model_path=str(model_dir),
            ppo_config_path=str(ppo_yaml), min_samples_for_training=samples, max_samples_per_run=samples,
            training_tmp_root=str(case_dir / "train-tmp"), lora_activation_timeout=60.0,
            training_policy={"auto": True, "min_pending_samples": samples, "poll_interval_seconds": 0.2,
                             "max_concurrent_runs": concurrent},
            local={"warm_trainer": mode != "per-run", "max_runs_per_step": concurrent, "gather_seconds": 0.2},
        )
        backend = make_backend(config, LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        timed = Timed(backend)
        cpu0 = cpu_seconds()
        with TreeSampler() as sampler:
            async with running_app(config, backend=backend) as (app, client):
                deps = app.state.deps
                started = time.perf_counter()
                for name in names:
                    await deps.samples.publisher.insert_if_absent([PackedSample.from_document(d)
                                                       for d in lineage_docs(name, pool, samples)])
                published_at, published_perf = time.time(), time.perf_counter()
                records: dict[str, Any] = {}
                while len(records) < size:
                    await asyncio.sleep(0.2)
                    for run_id in list(timed.calls):
                        if run_id in records or "train_end" not in timed.calls[run_id]:
                            continue
                        run = await deps.runner.get(run_id)
                        if run.terminal and run.status != "succeeded":
                            raise RuntimeError(f"run {run_id} ended {run.status}: {run.failure_reason}")
                        if run.status == "succeeded" and (run.freshness or {}).get("policy_at"):
                            records[run.lineage] = run
                    if time.perf_counter() - started > 3600:
                        raise RuntimeError("not all lineages trained within an hour")
                wall = time.perf_counter() - started
            await backend.close()  # the warm trainer ends (and is reaped) with its service
        cpu = cpu_seconds() - cpu0
    await redis.aclose()
    runs = list(records.values())
    s2p = [r.freshness["sample_to_policy_seconds"]["p50"] for r in runs]
    waits = [r.freshness.get("eligible_wait_seconds") or 0.0 for r in runs]
    steps = [sum(s.get("seconds", 0.0) for s in r.metrics.get("step_metrics", [])) for r in runs]
    phases = []
    for r in runs:
        call = timed.calls[r.training_run_id]
        created, begun = iso_epoch(r.created_at), iso_epoch(r.started_at)
        policy_at = iso_epoch(r.freshness["policy_at"])
        step_s = sum(s.get("seconds", 0.0) for s in r.metrics.get("step_metrics", []))
        phases.append({
            "claim_to_start_s": (begun - created) if created and begun else None,
            "trainer_s": call.get("worker_s"),
            "steps_s": step_s,
            "publish_s": call["train_s"] - call.get("worker_s", 0.0),
            "activation_s": policy_at - (published_at - (published_perf - call["train_end"])) if policy_at else None,
        })
    return {
        "mode": mode, "lineages": size, "samples_per_lineage": samples, "concurrent_runs": concurrent,
        "wall_s": wall, "lineages_per_minute": 60 * size / wall, "cpu_s": cpu, "peak_rss_mib": sampler.peak_mib,
        "peak_trainer_rss_mib": sampler.peak_child_mib,
        "sample_to_policy_p50_s": pct(s2p, 0.5), "sample_to_policy_p95_s": pct(s2p, 0.95),
        "eligible_wait_p50_s": pct(waits, 0.5), "eligible_wait_p95_s": pct(waits, 0.95),
        "steps_s_median": statistics.median(steps), "steps_s_sum": sum(steps),
        "trainer_starts": getattr(backend, "trainer_starts", size),
        "phases_median": {key: statistics.median([p[key] for p in phases if p[key] is not None] or [0.0])
                          for key in phases[0]},
    }


PPO_YAML = """
data:
  max_prompt_length: {prompt}
  max_response_length: {response}
"""


async def run_all(args: argparse.Namespace, tmp: Path, redis_url: str) -> dict[str, Any]:
    if args.model == "tiny":
        from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model

        model_dir = make_tiny_model(tmp / "model", seed=0)
    else:
        from openjiuwen.agent_evolving.agent_rl.model_makers import smollm2

        model_dir, _ = smollm2.provision(smollm2.default_cache_dir())
    pool = make_pool(model_dir, args.samples, args.prompt_tokens, args.response_tokens)
    ppo_yaml = tmp / "ppo.yaml"
    ppo_yaml.write_text(PPO_YAML.format(prompt=args.prompt_tokens + 8, response=args.response_tokens + 8))
    startup = statistics.median(startup_seconds() for _ in range(2))
    print(f"model {args.model}: interpreter start-up + imports {startup:.2f} s", flush=True)
    rows = []
    print(f"  {'mode':>8} {'N':>4} {'K':>3} {'wall s':>8} {'steps/run':>9} {'s2p p50':>8} {'s2p p95':>8} "
          f"{'wait p95':>8} {'cpu s':>7} {'peak MiB':>8}", flush=True)
    for size in args.sizes:
        for mode in args.modes:
            row = await run_case(redis_url, tmp, model_dir, pool, size=size, mode=mode, k=args.k,
                                 samples=args.samples, ppo_yaml=ppo_yaml)
            rows.append(row)
            print(f"  {mode:>8} {size:>4} {row['concurrent_runs']:>3} {row['wall_s']:>8.1f} "
                  f"{row['steps_s_median']:>9.2f} {row['sample_to_policy_p50_s']:>8.1f} "
                  f"{row['sample_to_policy_p95_s']:>8.1f} {row['eligible_wait_p95_s']:>8.1f} {row['cpu_s']:>7.1f} "
                  f"{row['peak_rss_mib']:>8.0f}", flush=True)
    one = min((r for r in rows if r["mode"] == "per-run"), key=lambda r: r["lineages"], default=None)
    goals = []
    if one is not None:
        step = one["steps_s_median"]
        for row in rows:
            if row["lineages"] > 1:
                goal = startup + 1.25 * row["lineages"] * step
                goals.append({"mode": row["mode"], "lineages": row["lineages"], "wall_s": row["wall_s"],
                              "goal_s": goal, "ratio": row["wall_s"] / goal})
        print(f"one lineage's run today (per-run, N={one['lineages']}), medians: {one['phases_median']}", flush=True)
        for g in goals:
            print(f"  goal {g['mode']:>8} N={g['lineages']:>3}: wall {g['wall_s']:.1f} s vs start-up + 1.25 x N x "
                  f"step = {g['goal_s']:.1f} s ({g['ratio']:.2f}x)", flush=True)
    return {"model": args.model, "samples": args.samples, "prompt_tokens": args.prompt_tokens,
            "response_tokens": args.response_tokens, "startup_s": startup, "k": args.k, "rows": rows,
            "goals": goals, "machine": machine_facts()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64], help="lineages eligible at once")
    parser.add_argument("--samples", type=int, default=8, help="pending samples per lineage (its threshold)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--k", type=int, default=8, help="warm-k: concurrent runs trained together")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 2 lineages of 4 short samples, per-run and warm-k (about a minute)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "lineage_training.json"))
    args = parser.parse_args()
    if args.quick:
        args.model, args.sizes, args.modes, args.k = "tiny", [2], ["per-run", "warm-k"], 2
        args.samples, args.prompt_tokens, args.response_tokens = 4, 16, 8
    with tempfile.TemporaryDirectory(prefix="lineage-training-") as tmp, \
            RedisServer(Path(tmp) / "redis") as redis_server:
        result = asyncio.run(run_all(args, Path(tmp), redis_server.url))
    result["load_avg_end"] = list(os.getloadavg())
    print(f"load average at the end: {result['load_avg_end']}")
    print(f"wrote {write_result(result, args.out)}")


if __name__ == "__main__":
    main()
