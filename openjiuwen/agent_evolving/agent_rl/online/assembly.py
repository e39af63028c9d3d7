"""The RL Service's composition root (named as the gateway's, gateway/assembly.py): builds every long-lived part of
one process from its config and connects them.

No I/O and no environment beyond the trainer backend's own variables: the process entry (service.py) reads the
environment and runs the app; the leader's duties (leader_duties.py) run the parts the leader alone runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.asyncio import BlockingConnectionPool, Redis

from .tasks.lifecycle import TaskLifecycle
from .capture.ledger import CaptureLedger
from .capture.pipeline import CapturePipeline
from .capture.turn_ledger import TurnLedger
from .rewards.projector import RewardProjector
from .capture.turns import TurnPublisher
from .config import ConfigError, RLServiceConfig
from .leader_duties import LeaderDuties
from .lineage_lifecycle import LineageLifecycle
from .lineage_purge import LineagePurge
from .lineages import LineageRegistry
from .lora.gateway_client import GatewayLoraClient
from .lora.repository import LoraRepository
from .metrics import MeteredJudge, ServiceMetrics
from .rail_ingest.ingest import RailIngestor
from .rail_ingest.jsonl_copy import RailRecorder
from .retention import RetentionSweeper
from .rewards.ledger import RewardLedger
from .rewards.reward_policy import RewardPolicy
from .rewards.sweeper import RewardDeadlineSweeper
from .rollout.changes import RolloutChanges
from .rollout.controller import RolloutController
from .rollout.decision_loop import DecisionLoop
from .rollout.evaluation import CanaryEvaluation
from .rollout.store import RolloutStore
from .store import keys
from .store.instance_exclusion import InstanceExclusion
from .store.outdated_samples import OutdatedSamples
from .store.reward_view import RewardRules
from .store.sample_deletion import SampleDeletion
from .store.sample_documents import SampleDocuments
from .store.sample_line import SampleLine
from .store.sample_listing import SampleListing
from .store.sample_metrics import SampleMetrics
from .store.sample_publisher import SamplePublisher
from .store.sample_stats import SampleStats
from .tasks.registry import TaskRegistry
from .tasks.signals import TaskSignals
from .training.backends import TrainerBackend
from .training.freshness import Freshness
from .training.pauses import LineagePauses
from .training.runner import TrainingRunner
from .training.durable_writes import DurableWrites
from .training.run_activation import RunActivation
from .training.run_claims import RunClaims
from .training.run_executions import RunExecutions
from .training.run_reads import RunReads
from .training.run_transitions import RunTransitions
from .training.scheduler import TrainingScheduler
from .workers.coordinator import Placement, WorkerCoordinator, make_fence
from .store.fence import Fence
from .workers.membership import Membership

if TYPE_CHECKING:
    from .judge import Judge

SCRIPTED_PLAN_ENV = "ONLINE_RL_SCRIPTED_PLAN"  # tests only: the plan file of the scripted backend
VISIBLE_DEVICES_ENV = "ONLINE_RL_VISIBLE_DEVICES_ENV"  # verl: the variable training_gpu_ids is exported as
REDIS_MAX_CONNECTIONS = 512  # per process; Redis serves 10,000 clients by default
REDIS_POOL_WAIT_S = 20.0  # a request waits this long for a pooled connection, then fails as on a Redis outage


class OwnerMismatch(RuntimeError):
    """The Redis database belongs to another model id."""


@dataclass(frozen=True)
class SampleStore:
    """The samples of one model (store/), one part per job; each holder is handed the parts it uses."""

    line: SampleLine  # the default line: key names and queued moves; `for_line` / `for_lineage` give the others
    publisher: SamplePublisher  # publication (the capture path)
    listing: SampleListing
    documents: SampleDocuments
    exclusion: InstanceExclusion
    deletion: SampleDeletion
    outdated: OutdatedSamples
    stats: SampleStats


def make_sample_store(
    redis: Redis,
    *,
    model_id: str,
    max_policy_lag: int | None = None,
    reward_policy: RewardRules | None = None,
    metrics: SampleMetrics | None = None,
    constrained: Mapping[str, str] | None = None,
) -> SampleStore:
    """The sample store of `model_id`, its parts sharing one default line."""
    line = SampleLine(owner=model_id, model_id=model_id, reward_policy=reward_policy)
    return SampleStore(
        line=line,
        publisher=SamplePublisher(redis, line, metrics=metrics, constrained=constrained),
        listing=SampleListing(redis),
        documents=SampleDocuments(redis, line),
        exclusion=InstanceExclusion(redis, line),
        deletion=SampleDeletion(redis, line),
        outdated=OutdatedSamples(redis, metrics=metrics),
        stats=SampleStats(redis, max_policy_lag=max_policy_lag),
    )


@dataclass
class ServiceDeps:
    """Every long-lived part of one service process, wired. Building it does no I/O; the process entry's lifespan
    (service.py) connects and the coordinator runs the leader's duties (leader_duties.py) under the lease."""

    config: RLServiceConfig
    redis: Redis
    registry: TaskRegistry
    ledger: CaptureLedger  # a Task's captures (the hooks' path)
    turns: TurnLedger  # a Task's turn publication (delayed feedback)
    samples: SampleStore
    judge: "Judge | None"
    publisher: TurnPublisher
    pipeline: CapturePipeline
    lifecycle: TaskLifecycle
    rewards: RewardProjector
    sweeper: RetentionSweeper
    reward_ledger: RewardLedger
    reward_sweeper: RewardDeadlineSweeper
    rail: RailIngestor
    repository: LoraRepository
    gateway: GatewayLoraClient
    backend: TrainerBackend
    runner: TrainingRunner
    metrics: ServiceMetrics
    rollout: RolloutController
    rollout_decisions: DecisionLoop  # the leader's decision loop over the live canaries
    membership: Membership
    scheduler: TrainingScheduler
    fence: Fence  # every leader-only write goes through it (store/fence.py)
    lineages: LineageRegistry
    lineage_lifecycle: LineageLifecycle
    duties: LeaderDuties = field(init=False)
    coordinator: WorkerCoordinator = field(init=False)

    @classmethod
    def build(
        cls,
        config: RLServiceConfig,
        *,
        redis: Redis | None = None,
        judge: "Judge | None" = None,
        backend: TrainerBackend | None = None,
        token: str | None = None,
        placement: Placement | None = None,
    ) -> "ServiceDeps":
        placement = placement or Placement()
        redis = redis or make_redis(config)
        membership = Membership(redis, boot=placement.boot, slot=placement.index, solo=placement.solo)
        fence = make_fence(placement)
        judge = judge if judge is not None else make_judge(config)
        # Per app: its own CollectorRegistry.
        metrics = ServiceMetrics(config.model_id, lineage_top_k=config.lineages.metrics_label_top_k)
        metered_judge = MeteredJudge(judge, metrics) if judge is not None else None
        registry = TaskRegistry(redis, signals=TaskSignals(), metrics=metrics, max_lineages=config.lineages.max_count)
        ledger = CaptureLedger(redis, signals=registry.signals)
        turns = TurnLedger(redis, signals=registry.signals)
        reward_policy = RewardPolicy(config.reward_policy)  # empty (unconfigured) when the section is absent
        samples = make_sample_store(
            redis, model_id=config.model_id, max_policy_lag=config.max_policy_lag, reward_policy=reward_policy,
            metrics=metrics, constrained=config.constrained_samples.policy(),
        )
        reward_ledger = RewardLedger(redis, samples.line, reward_policy, owner=config.model_id)
        publisher = TurnPublisher(registry, turns, samples.publisher, samples.deletion, metered_judge, metrics=metrics,
                                  membership=membership)
        rewards = RewardProjector(redis, samples.publisher)
        repository = LoraRepository(config.lora_repository_path, model_id=config.model_id)
        gateway = _make_gateway_client(config, token, metrics)
        backend = backend or make_backend(config, repository)
        rollout, decisions, runner, reads = _make_training(
            config, redis, samples, backend, repository, gateway, metrics, fence)
        deps = cls(
            config=config,
            redis=redis,
            registry=registry,
            ledger=ledger,
            turns=turns,
            samples=samples,
            judge=judge,
            publisher=publisher,
            pipeline=CapturePipeline(registry, ledger, turns, publisher,
                                     turn_publish_timeout_s=config.turn_publish_timeout_seconds),
            lifecycle=TaskLifecycle(registry, turns, publisher, model_id=config.model_id,
                                    judge_configured=judge is not None),
            rewards=rewards,
            sweeper=_make_retention_sweeper(config, redis, samples, rewards, metrics, fence),
            reward_ledger=reward_ledger,
            reward_sweeper=RewardDeadlineSweeper(reward_ledger, fence=fence, interval_s=reward_policy.sweep_interval_s),
            rail=_make_rail_ingestor(config, redis, samples.publisher, metered_judge, membership),
            repository=repository,
            gateway=gateway,
            backend=backend,
            runner=runner,
            metrics=metrics,
            rollout=rollout,
            rollout_decisions=decisions,
            membership=membership,
            scheduler=TrainingScheduler(
                redis, runs=reads, runner=runner, line=samples.line, outdated=samples.outdated, rollout=rollout,
                pauses=LineagePauses(redis, model_id=config.model_id), fence=fence, policy=config.training_policy,
                model_id=config.model_id, max_policy_lag=config.max_policy_lag,
            ),
            fence=fence,
            lineages=LineageRegistry(redis, model_id=config.model_id, runs=reads),
            lineage_lifecycle=LineageLifecycle(
                redis, gateway=gateway, fence=fence, model_id=config.model_id,
                purge=LineagePurge(redis, samples.line, samples.deletion, repository, model_id=config.model_id,
                                   fence=fence),
                base_model_path=config.base_model_path, idle_archive_s=config.lineages.idle_archive_seconds,
                interval_s=config.lineages.lifecycle_interval_seconds,
            ),
        )
        deps.duties = _make_duties(deps)
        deps.coordinator = WorkerCoordinator(redis, placement, membership, deps.duties, fence,
                                             leader_check=runner.check_health)
        return deps

    async def claim_owner(self) -> None:
        """Startup step 1: this database belongs to exactly one model id."""
        await self.redis.set(keys.OWNER, self.config.model_id, nx=True)
        owner = await self.redis.get(keys.OWNER)
        if owner is not None and owner.decode() != self.config.model_id:
            raise OwnerMismatch("this Redis database belongs to another model id; refusing to start")

    async def aclose(self) -> None:
        await self.backend.close()
        await self.gateway.aclose()
        if self.judge is not None:
            await self.judge.aclose()
        await self.redis.aclose()


def _make_duties(deps: ServiceDeps) -> LeaderDuties:
    return LeaderDuties(
        deps.redis, fence=deps.fence, lifecycle=deps.lifecycle, rewards=deps.rewards, rail=deps.rail,
        rollout=deps.rollout, rollout_decisions=deps.rollout_decisions, runner=deps.runner, sweeper=deps.sweeper,
        reward_ledger=deps.reward_ledger, reward_sweeper=deps.reward_sweeper, scheduler=deps.scheduler,
        lineages=deps.lineage_lifecycle, training_tmp_root=deps.config.training_tmp_root,
        # The coordinator is built after the duties it runs: the call finds it then, at shutdown.
        wait_alone=lambda timeout_s: deps.coordinator.wait_alone(timeout_s),
    )


def make_redis(config: RLServiceConfig) -> Redis:
    """This process's Redis client. Its pool blocks for a free connection instead of failing: redis-py's default
    pool raises `Too many connections` past 100, which 256 concurrent agent sessions reached (500 on a Task start)."""
    pool = BlockingConnectionPool.from_url(config.redis_url.get_secret_value(), max_connections=REDIS_MAX_CONNECTIONS,
                                           timeout=REDIS_POOL_WAIT_S)
    return Redis(connection_pool=pool, decode_responses=False)


def make_judge(config: RLServiceConfig) -> "Judge | None":
    """The Judge of `judge_*`, or None when no judge endpoint is configured."""
    if not config.judge_configured:
        return None
    from .judge import JudgeScorer

    return JudgeScorer(
        endpoint=config.judge_endpoint,
        model=config.judge_model,
        api_key=config.judge_api_key.get_secret_value(),
        votes=config.judge_votes,
        min_votes=config.judge_min_votes,
        retries=config.judge_retries,
        timeout_s=config.judge_timeout,
    )


def _make_gateway_client(config: RLServiceConfig, token: str | None, metrics: ServiceMetrics) -> GatewayLoraClient:
    return GatewayLoraClient(
        endpoint=config.aigw_endpoint,
        model_id=config.model_id,
        timeout_s=config.lora_activation_timeout,
        attempts=config.lora_activation_attempts,
        token=token,
        on_attempt=metrics.activation_attempt,
    )


def _make_training(
    config: RLServiceConfig,
    redis: Redis,
    samples: SampleStore,
    backend: TrainerBackend,
    repository: LoraRepository,
    gateway: GatewayLoraClient,
    metrics: ServiceMetrics,
    fence: Fence,
) -> tuple[RolloutController, DecisionLoop, TrainingRunner, RunReads]:
    """Training Runs and the rollout of what they produce: the rollout controller and its decision loop, the runner,
    the run reads."""
    runs = RunTransitions(
        redis, samples.line, model_id=config.model_id, run_retention_s=config.run_retention_seconds, fence=fence,
        metrics=metrics,
    )
    reads = RunReads(redis)
    freshness = Freshness(redis, reads, runs, metrics)
    rollouts = RolloutStore(redis, fence=fence)
    changes = RolloutChanges(
        rollouts, gateway, repository, model_id=config.model_id, base_model_path=config.base_model_path,
        observe_policy=runs.observe_policy, metrics=metrics, on_promoted=freshness.promoted,
    )
    evaluation = CanaryEvaluation(redis, config.rollout)
    rollout = RolloutController(
        redis, rollouts, gateway, repository, changes, evaluation, config=config.rollout, model_id=config.model_id,
        base_model_path=config.base_model_path, active_run=reads.active_of,
    )
    decisions = DecisionLoop(rollouts, changes, evaluation, config=config.rollout, metrics=metrics)
    durable = DurableWrites()  # both parts wait out the same Redis outage budget
    activation = RunActivation(
        runs, repository, gateway, durable, model_id=config.model_id, base_model_path=config.base_model_path,
        metrics=metrics, rollout=rollout, freshness=freshness,
    )
    executions = RunExecutions(
        runs, reads, samples.documents, backend, repository, activation, durable, model_id=config.model_id,
        base_model_path=config.base_model_path, tmp_root=config.training_tmp_root, metrics=metrics,
    )
    runner = TrainingRunner(
        runs,
        backend,
        gateway,
        claims=RunClaims(redis, samples.line, samples.outdated, model_id=config.model_id, fence=fence),
        run_reads=reads,
        executions=executions,
        activation=activation,
        model_id=config.model_id,
        min_samples=config.min_samples_for_training,
        max_samples=config.max_samples_per_run,
        max_policy_lag=config.max_policy_lag,
        metrics=metrics,
        rollout=rollout,
        policy=config.training_policy,
    )
    return rollout, decisions, runner, reads


def _make_retention_sweeper(
    config: RLServiceConfig, redis: Redis, samples: SampleStore, rewards: RewardProjector, metrics: ServiceMetrics,
    fence: Fence,
) -> RetentionSweeper:
    return RetentionSweeper(
        redis,
        samples.line,
        samples.deletion,
        rewards,
        fence=fence,
        owner=config.model_id,
        task_retention_s=config.task_retention_seconds,
        reward_timeout_s=config.reward_timeout_seconds,
        trajectory_retention_s=config.trajectory_retention_seconds,
        run_retention_s=config.run_retention_seconds,
        interval_s=config.retention_sweep_interval_seconds,
        on_error=metrics.exception,
    )


def _make_rail_ingestor(
    config: RLServiceConfig, redis: Redis, samples: SamplePublisher, judge: "Judge | None", membership: Membership,
) -> RailIngestor:
    recorder = RailRecorder(
        config.record_dir, max_bytes=config.record_max_bytes, backup_count=config.record_backup_count
    )
    return RailIngestor(
        redis, samples, judge, model_id=config.model_id, retention_seconds=config.trajectory_retention_seconds,
        recorder=recorder, membership=membership,
    )


def make_backend(config: RLServiceConfig, repository: LoraRepository) -> TrainerBackend:
    """The trainer backend named by `trainer_backend`; heavy imports happen only for the one chosen."""
    if config.trainer_backend == "scripted":
        from .training.backends.scripted import ScriptedBackend

        return ScriptedBackend(repository, plan_path=os.environ.get(SCRIPTED_PLAN_ENV) or None)
    if config.trainer_backend == "local":
        from .training.backends.local import LocalBackend
        from .training.ppo_settings import load_ppo_settings

        settings = load_ppo_settings(
            advantage_estimator=config.advantage_estimator,
            tis_cap=config.tis_cap,
            ppo_samples_per_step=config.ppo_samples_per_step,
            ppo_config_path=config.ppo_config_path,
            env=os.environ,
        )
        if config.local.warm_trainer:
            from .training.backends.warm_local import WarmLocalBackend

            return WarmLocalBackend(repository, settings=settings, tmp_root=config.training_tmp_root,
                                    max_group=config.local.max_runs_per_step, gather_s=config.local.gather_seconds)
        return LocalBackend(repository, settings=settings, tmp_root=config.training_tmp_root)
    from .training.backends.verl import VerlBackend
    from .training.verl.compose import compose_ppo_config, settings_from_config

    try:  # PPOConfigError (a broken ppo_config_path or override) and GPU/rank mismatches are ValueErrors
        ppo_config = compose_ppo_config(
            advantage_estimator=config.advantage_estimator,
            tis_cap=config.tis_cap,
            ppo_config_path=config.ppo_config_path,
            env=os.environ,
        )
        return VerlBackend(
            repository,
            model_id=config.model_id,
            ppo_config=ppo_config,
            settings=settings_from_config(
                ppo_config, tis_cap=config.tis_cap, ppo_samples_per_step=config.ppo_samples_per_step
            ),
            ray_address=config.ray_address,
            nproc_per_node=config.nproc_per_node,
            training_gpu_ids=config.training_gpu_ids,
            visible_devices_env=os.environ.get(VISIBLE_DEVICES_ENV) or "CUDA_VISIBLE_DEVICES",
            gpus_per_rank=config.ray_gpus_per_rank,
            cpus_per_rank=config.ray_cpus_per_rank,
            placement_timeout_s=config.ray_placement_timeout_seconds,
            tmp_root=config.training_tmp_root,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
