"""Prometheus metrics of the RL Service (CONTRACT §2.3): one `ServiceMetrics` per app, on its own
`CollectorRegistry` (no process-global registry, so app instances never share series), every series labelled
`model_id`.

Recording is in-process only (a counter or histogram update, no Redis round trip on the hook path). Gauges that
describe stored state (`rl_trajectories`, `rl_tasks`, `rl_lora_active_version`) are read at scrape time from the
O(1) counters and index sizes, in one pipelined round trip.

Under a worker group (`workers` > 1, workers/group.py) every worker records into the group's private directory
(prometheus_client's multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`), and a scrape of any worker answers the sum of
the group's counters and histograms; a gauge answers the value last set by any worker (`mostrecent`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

import orjson
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from redis.asyncio import Redis
from redis.exceptions import RedisError

from ..common.http_metrics import FAST_BUCKETS_S
from ..common.ids import lora_version
from ..common.lineage_labels import LineageLabels
from ..common.wire.task_states import TaskStatus
from .store import keys

if TYPE_CHECKING:
    from .judge import Judge, JudgeResult

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
LAST = "mostrecent"  # a gauge of a worker group: the value last set by any worker
SLOW_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)
# A sample may wait hours for its line's threshold or a canary's verdict: up to two days.
FRESHNESS_BUCKETS_S = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0,
                       172800.0)
LINEAGE_GRANT_AFTER = 3  # runs a lineage needs before it takes a free label slot of the freshness histograms
LINEAGE_IDLE_S = 86400.0  # a lineage without a run for this long may lose its label to one that earns it


class ServiceMetrics:
    def __init__(self, model_id: str, *, lineage_top_k: int = 20) -> None:
        self.model_id = model_id
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ("model_id",)
        self.http_requests = Counter("rl_http_requests_total", "HTTP answers by route template and status",
                                     m + ("route", "status"), registry=r)
        self.hook_duration = Histogram("rl_hook_duration_seconds", "Capture hook handling time",
                                       m + ("hook",), buckets=FAST_BUCKETS_S, registry=r)
        self.captures = Counter("rl_captures_total", "Capture hook outcomes: committed, discarded, rejected",
                                m + ("result",), registry=r)
        self.tasks_created = Counter("rl_tasks_total", "Tasks created", m + ("reward_mode",), registry=r)
        self.tasks_finished = Counter("rl_tasks_finished_total", "Tasks that reached a terminal status",
                                      m + ("status", "reason"), registry=r)
        self.tasks = Gauge("rl_tasks_by_status",
                           "Tasks by status (active: the recovery index; terminal: still retained)",
                           m + ("status",), registry=r, multiprocess_mode=LAST)
        self.turn_publish = Histogram("rl_turn_publish_duration_seconds", "Delayed-feedback turn publication time",
                                      m, buckets=FAST_BUCKETS_S[4:] + (60.0, 120.0), registry=r)
        self.judge_requests = Counter("rl_judge_requests_total", "Judge scorings by result (ok, failed)",
                                      m + ("result",), registry=r)
        self.judge_duration = Histogram("rl_judge_duration_seconds", "Time of one Judge scoring (all votes)",
                                        m, buckets=FAST_BUCKETS_S[5:] + (60.0, 120.0), registry=r)
        self.judge_votes = Counter("rl_judge_votes_total", "Judge votes by result (ok, fail)", m + ("result",),
                                   registry=r)
        self.samples_published = Counter("rl_samples_published_total", "Samples inserted into the trajectory store",
                                         m + ("source",), registry=r)
        self.trajectories = Gauge("rl_trajectories", "Samples by status (from the O(1) counters)",
                                  m + ("status",), registry=r, multiprocess_mode=LAST)
        self.training_runs = Counter("rl_training_runs_total", "Training Runs that reached a terminal status",
                                     m + ("status",), registry=r)
        self.runs_started = Counter("rl_training_runs_started_total",
                                    "Training Runs started, by trigger (manual or auto)", m + ("trigger",),
                                    registry=r)
        self.stage_duration = Histogram("rl_training_stage_duration_seconds",
                                        "Time a Training Run spent in a stage, by how the stage ended",
                                        m + ("stage", "outcome"), buckets=SLOW_BUCKETS_S, registry=r)
        # Freshness per lineage (docs/training.md "Freshness"). The `lineage` label is bounded like the gateway's
        # (common/lineage_labels.py): `default`, at most `lineages.metrics_label_top_k` lineages that keep training
        # (granted once they ran LINEAGE_GRANT_AFTER runs while a slot was free; a label idle LINEAGE_IDLE_S goes to
        # the next lineage that earns one, its series removed), every other lineage `other`.
        self.eligible_wait = Histogram("rl_training_eligible_wait_seconds",
                                       "Time a line waited from eligible (automatic training) to its run's start, "
                                       "by lineage (bounded label)", m + ("lineage",), buckets=FRESHNESS_BUCKETS_S,
                                       registry=r)
        self.sample_to_policy = Histogram("rl_sample_to_policy_seconds",
                                          "Per trained sample: its creation to the activation or promotion of the "
                                          "first version trained on it, by lineage (bounded label)",
                                          m + ("lineage",), buckets=FRESHNESS_BUCKETS_S, registry=r)
        self.training_lineages = LineageLabels(lineage_top_k, grant_after=LINEAGE_GRANT_AFTER, idle_s=LINEAGE_IDLE_S,
                                               released=self._drop_training_lineage)
        self.runs_active = Gauge("rl_training_runs_active", "Training Runs live now (every lineage)", m,
                                 registry=r, multiprocess_mode=LAST)
        self.samples_outdated = Counter("rl_samples_outdated_total",
                                        "Pending samples that became `outdated` (policy lag past max_policy_lag)",
                                        m, registry=r)
        self.activation_attempts = Counter("rl_lora_activation_attempts_total",
                                           "Activation requests to the gateway by result", m + ("result",),
                                           registry=r)
        self.activation_duration = Histogram("rl_lora_activation_duration_seconds",
                                             "Activation of a new version, retries included, by result",
                                             m + ("result",), buckets=SLOW_BUCKETS_S, registry=r)
        # The sampling report of the last trained run (docs/training.md "Sampling"): captured vs recomputed logprobs.
        self.logprob_mismatch = Gauge("rl_training_logprob_mismatch",
                                      "|captured - recomputed| logprob over the last trained run's tokens (mean, max)",
                                      m + ("stat",), registry=r, multiprocess_mode=LAST)
        self.ratio_clipped = Gauge("rl_training_ratio_clipped_share",
                                   "Share of the last trained run's tokens whose importance ratio was clipped",
                                   m, registry=r, multiprocess_mode=LAST)
        self.lora_active_version = Gauge("rl_lora_active_version",
                                         "N of the last active policy <model>:vN seen on the gateway (0 = base)",
                                         m, registry=r, multiprocess_mode=LAST)
        self.redis_errors = Counter("rl_redis_errors_total", "Redis errors seen by requests, sweeps and scrapes",
                                    m, registry=r)
        # Rollouts (docs/rollout.md): the canary's arms as the last decision round saw them, and the decisions.
        # `lineage` is bounded by the live canaries (docs/lineages.md "Rollout per lineage"): `default` always,
        # another lineage only while its line's canary is live (its series go when the canary ends).
        self.rollout_arm_tasks = Gauge("rl_rollout_arm_tasks", "Tasks of the running canary window by lineage, arm "
                                       "and outcome (started, ended, failed, rewarded)",
                                       m + ("lineage", "arm", "outcome"), registry=r, multiprocess_mode=LAST)
        self.rollout_arm_reward = Gauge("rl_rollout_arm_reward_mean",
                                        "Mean per-Task reward of each arm of the running canary, by lineage",
                                        m + ("lineage", "arm"), registry=r, multiprocess_mode=LAST)
        self.rollout_in_progress = Gauge("rl_rollout_in_progress",
                                         "1 while a canary runs, by lineage and status (running, paused)",
                                         m + ("lineage", "status"), registry=r, multiprocess_mode=LAST)
        self._rollout_lineages: set[str] = set()  # non-default lineages with rollout series
        self.rollout_decisions = Counter("rl_rollout_decisions_total", "Rollout decisions by action, reason, by whom",
                                         m + ("action", "reason", "by"), registry=r)
        # Labelled children of the per-request series, looked up once (`.labels()` builds and hashes a key tuple
        # under a lock on every call). The label sets are bounded: route templates (or `unmatched`) x statuses the
        # app sends, the three hooks, the capture results.
        self._http_children: dict[tuple[str, int], Any] = {}
        self._hook_children: dict[str, Any] = {}
        self._capture_children: dict[str, Any] = {}

    # ------------------------------------------------------------ recording (cheap, in-process)

    def http(self, route: str, status: int) -> None:
        child = self._http_children.get((route, status))
        if child is None:
            child = self._http_children[(route, status)] = self.http_requests.labels(self.model_id, route,
                                                                                      str(status))
        child.inc()

    @contextmanager
    def hook(self, hook: str) -> Iterator[None]:
        """Times a hook; a hook that raises (any non-2xx answer) counts its capture as rejected."""
        started = time.perf_counter()
        try:
            yield
        except BaseException:
            self.capture("rejected")
            raise
        finally:
            child = self._hook_children.get(hook)
            if child is None:
                child = self._hook_children[hook] = self.hook_duration.labels(self.model_id, hook)
            child.observe(time.perf_counter() - started)

    def capture(self, result: str) -> None:
        child = self._capture_children.get(result)
        if child is None:
            child = self._capture_children[result] = self.captures.labels(self.model_id, result)
        child.inc()

    def task_created(self, reward_mode: str) -> None:
        self.tasks_created.labels(self.model_id, reward_mode).inc()

    def task_finished(self, status: str, reason: str) -> None:
        self.tasks_finished.labels(self.model_id, status, reason).inc()

    def turn_published(self, seconds: float) -> None:
        self.turn_publish.labels(self.model_id).observe(seconds)

    def published(self, source: str, n: int = 1) -> None:
        self.samples_published.labels(self.model_id, source or "unknown").inc(n)

    def run_finished(self, status: str) -> None:
        self.training_runs.labels(self.model_id, status).inc()

    def run_started(self, trigger: str) -> None:
        self.runs_started.labels(self.model_id, trigger).inc()

    def run_claimed(self, lineage: str, eligible_wait_s: float | None) -> None:
        """A run started: counts towards its lineage's label slot; its line's eligible-to-run wait when it had one."""
        label = self.training_lineages.label(lineage)
        if eligible_wait_s is not None:
            self.eligible_wait.labels(self.model_id, label).observe(max(0.0, eligible_wait_s))

    def _drop_training_lineage(self, lineage: str) -> None:
        for family in (self.eligible_wait, self.sample_to_policy):
            with suppress(KeyError):  # a label granted but never observed has no series
                family.remove(self.model_id, lineage)

    def policy_live(self, lineage: str, latencies_s: list[float]) -> None:
        """A version became its line's policy: each trained sample's creation-to-policy latency."""
        child = self.sample_to_policy.labels(self.model_id, self.training_lineages.known(lineage))
        for seconds in latencies_s:
            child.observe(max(0.0, seconds))

    def outdated(self, n: int) -> None:
        self.samples_outdated.labels(self.model_id).inc(n)

    def run_sampling(self, report: dict[str, Any]) -> None:
        self.logprob_mismatch.labels(self.model_id, "mean").set(report["logprob_mismatch_mean"])
        self.logprob_mismatch.labels(self.model_id, "max").set(report["logprob_mismatch_max"])
        self.ratio_clipped.labels(self.model_id).set(report["ratio_clipped_share"])

    def stage(self, stage: str, outcome: str, seconds: float) -> None:
        self.stage_duration.labels(self.model_id, stage, outcome).observe(max(0.0, seconds))

    def activation_attempt(self, result: str) -> None:
        self.activation_attempts.labels(self.model_id, result).inc()

    def activation(self, result: str, seconds: float) -> None:
        self.activation_duration.labels(self.model_id, result).observe(seconds)

    def rollout_state(self, status: str | None, decision: Any, lineage: str = "default") -> None:
        """A line's canary status and arms as one decision round saw them; zeros when none runs (the default
        line)."""
        if lineage != "default":
            self._rollout_lineages.add(lineage)
        for state in ("running", "paused"):
            self.rollout_in_progress.labels(self.model_id, lineage, state).set(1 if status == state else 0)
        arms = decision.arms if decision is not None else {}
        for arm in ("candidate", "active"):
            row = arms.get(arm) or {}
            reward = row.get("reward") or {}
            for outcome, value in (("started", row.get("tasks")), ("ended", row.get("ended")),
                                   ("failed", row.get("failed")), ("rewarded", reward.get("n"))):
                self.rollout_arm_tasks.labels(self.model_id, lineage, arm, outcome).set(value or 0)
            self.rollout_arm_reward.labels(self.model_id, lineage, arm).set(reward.get("mean") or 0.0)

    def rollout_lines(self, live: set[str]) -> None:
        """Drop the series of every non-default lineage whose canary is no longer live, so the label stays bounded
        by the live canaries. Zeroed first: in a worker group the value files keep a removed child's last value."""
        for lineage in self._rollout_lineages - live:
            self.rollout_state(None, None, lineage)
            for status in ("running", "paused"):
                self.rollout_in_progress.remove(self.model_id, lineage, status)
            for arm in ("candidate", "active"):
                for outcome in ("started", "ended", "failed", "rewarded"):
                    self.rollout_arm_tasks.remove(self.model_id, lineage, arm, outcome)
                self.rollout_arm_reward.remove(self.model_id, lineage, arm)
            self._rollout_lineages.discard(lineage)

    def rollout_decision(self, action: str, reason: str, by: str) -> None:
        self.rollout_decisions.labels(self.model_id, action, reason, by).inc()

    def redis_error(self) -> None:
        self.redis_errors.labels(self.model_id).inc()

    def exception(self, exc: BaseException) -> None:
        """An exception escaped a request: count it when Redis caused it."""
        if isinstance(exc, RedisError):
            self.redis_error()

    # ------------------------------------------------------------ scrape

    async def refresh(self, redis: Redis, stats: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Set the state gauges from the O(1) counters and index sizes; a Redis failure leaves them as they were
        and is counted, and the scrape still answers."""
        try:
            counts = await stats()
            async with redis.pipeline(transaction=False) as pipe:
                pipe.scard(keys.ACTIVE_TASKS)
                pipe.zcard(keys.tasks_by_status(TaskStatus.FINALIZED))
                pipe.zcard(keys.tasks_by_status(TaskStatus.ABORTED))
                pipe.get(keys.POLICY_OBSERVED)
                pipe.exists(keys.ACTIVE_RUN)
                pipe.hlen(keys.ACTIVE_LINEAGE_RUNS)
                active, finalized, aborted, observed, default_run, lineage_runs = await pipe.execute()
        except RedisError:
            self.redis_error()
            return
        for status, n in counts["by_status"].items():
            self.trajectories.labels(self.model_id, status).set(n)
        self.runs_active.labels(self.model_id).set(default_run + lineage_runs)
        S = TaskStatus
        for status, n in ((S.ACTIVE, active), (S.FINALIZED, finalized), (S.ABORTED, aborted)):
            self.tasks.labels(self.model_id, status).set(n)
        name = None
        if observed:
            try:
                name = orjson.loads(observed).get("lora_name")
            except (orjson.JSONDecodeError, AttributeError):
                name = None
        if isinstance(name, str):
            self.lora_active_version.labels(self.model_id).set(lora_version(name, self.model_id) or 0)

    def render(self) -> bytes:
        directory = os.environ.get(MULTIPROC_DIR_ENV)
        if not directory:
            return generate_latest(self.registry)
        group = CollectorRegistry()
        MultiProcessCollector(group, path=directory)
        return generate_latest(group)


class MeteredJudge:
    """A Judge that records each scoring's duration, result and votes; everything else is the wrapped Judge."""

    def __init__(self, judge: "Judge", metrics: ServiceMetrics) -> None:
        self._judge = judge
        self._metrics = metrics

    async def score(self, request: dict, response: dict, feedback: str) -> "JudgeResult":
        m = self._metrics
        started = time.perf_counter()
        try:
            result = await self._judge.score(request, response, feedback)
        except Exception:
            m.judge_requests.labels(m.model_id, "failed").inc()
            raise
        finally:
            m.judge_duration.labels(m.model_id).observe(time.perf_counter() - started)
        m.judge_requests.labels(m.model_id, "ok").inc()
        failed = sum(1 for v in result.votes if isinstance(v, str))
        if failed:
            m.judge_votes.labels(m.model_id, "fail").inc(failed)
        if len(result.votes) > failed:
            m.judge_votes.labels(m.model_id, "ok").inc(len(result.votes) - failed)
        return result

    async def aclose(self) -> None:
        await self._judge.aclose()
