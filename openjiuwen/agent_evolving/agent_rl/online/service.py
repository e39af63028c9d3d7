"""RL Service entry point: the one place that reads the environment, builds every part and wires them.

Run it as `python -m openjiuwen.agent_evolving.agent_rl.online.service --config FILE`, or serve the factory
`openjiuwen.agent_evolving.agent_rl.online.service:create_app` with uvicorn `--factory` and `RL_SERVICE_CONFIG` set.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import FastAPI
from redis.asyncio import BlockingConnectionPool, Redis

from ..common.content_type import BodyTypeGuard, JsonBodyMiddleware
from ..common.errors import INTERNAL_ERROR_MESSAGE, UnhandledErrors, install_error_envelope
from ..common.guards import GuardMiddleware, RequestGuard
from .api.fast_hooks import HookFastPath, ServiceApp
from .api.health import build_health_router
from .api.lineages import build_lineages_router
from .api.hooks import BINARY_ROUTES as HOOK_BINARY_ROUTES, CaptureHooks, build_hooks_router
from .api.metrics import build_metrics_router
from .api.policies import build_policies_router
from .api.rail import build_rail_router
from .api.rewards import build_rewards_router
from .api.rollout import build_rollout_router
from .api.tasks import build_tasks_router
from .api.training import build_training_router
from .api.trajectories import build_trajectories_router
from .capture.lifecycle import TaskLifecycle
from .capture.pipeline import CapturePipeline
from .capture.rewards import RewardProjector
from .capture.turns import TurnPublisher
from .config import ConfigError, RLServiceConfig, load_config
from . import faults
from .faults import CRASH_AT_ENV
from ..common.gc_tuning import tune_gc
from ..common.http_guard import ConnectionLimits, server_config
from .logs import configure_logging
from ..common.http_metrics import HttpMetricsMiddleware
from .metrics import MeteredJudge, ServiceMetrics
from .lora.gateway_client import GatewayLoraClient
from .lora.repository import LoraRepository
from .lineages import LineageRegistry
from .policies import PolicyReport
from ..common.private_files import UnsafeDirectoryError, ensure_private_root
from ..common.wire import env as wire_env
from .rail.ingest import RailIngestor
from .rail.records import RailRecorder
from .retention import RetentionSweeper
from .rewards.ledger import RewardLedger
from .rewards.policy import RewardPolicy
from .rewards.sweeper import RewardDeadlineSweeper
from .rollout.controller import RolloutController
from .rollout.store import RolloutStore
from .store import keys
from .store.trajectories import TrajectoryStore
from .tasks.registry import TaskRegistry
from .tasks.signals import TaskSignals
from .training.backends import TrainerBackend
from .training.runner import TrainingRunner
from .training.pauses import LineagePauses
from .training.runs import RunStore
from .training.scheduler import TrainingScheduler
from .watchdog import install_parent_death_watchdog
from .workers.coordinator import Placement, WorkerCoordinator, make_fence
from .store.lineage_backfill import ListingBackfill
from .workers.fence import Fence
from .workers.forward import LeaderForwarding
from .workers.group import WORKER_ENV, WorkerGroup, WorkerSlot
from .workers.membership import Membership

if TYPE_CHECKING:
    from .judge import Judge

log = logging.getLogger("openjiuwen.agent_rl.online.service")
api_log = logging.getLogger("openjiuwen.agent_rl.online.api")  # unhandled route errors

SCRIPTED_PLAN_ENV = "ONLINE_RL_SCRIPTED_PLAN"  # tests only: the plan file of the scripted backend
VISIBLE_DEVICES_ENV = "ONLINE_RL_VISIBLE_DEVICES_ENV"  # verl: the variable training_gpu_ids is exported as
# At shutdown the leader finishes the active Tasks only once the other workers left (their servers drained their
# hooks first), waiting at most this long.
SHUTDOWN_WAIT_FOR_WORKERS_S = 35.0
REDIS_MAX_CONNECTIONS = 512  # per process; Redis serves 10,000 clients by default
REDIS_POOL_WAIT_S = 20.0  # a request waits this long for a pooled connection, then fails as on a Redis outage


class OwnerMismatch(RuntimeError):
    """The Redis database belongs to another model id."""


@dataclass
class ServiceDeps:
    """Every long-lived part of one service process. Building it does no I/O; `lifespan` connects and recovers."""

    config: RLServiceConfig
    redis: Redis
    registry: TaskRegistry
    store: TrajectoryStore
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
    membership: Membership
    scheduler: TrainingScheduler
    fence: Fence  # every leader-only write goes through it (workers/fence.py)
    lineages: LineageRegistry
    coordinator: WorkerCoordinator = field(init=False)
    run_reward_sweeper: bool = field(init=False, default=False)

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
        metrics = ServiceMetrics(config.model_id)  # per app: its own CollectorRegistry
        metered_judge = MeteredJudge(judge, metrics) if judge is not None else None
        registry = TaskRegistry(redis, signals=TaskSignals(), metrics=metrics, max_lineages=config.lineages.max_count)
        reward_policy = RewardPolicy(config.reward_policy)  # empty (unconfigured) when the section is absent
        store = TrajectoryStore(
            redis, owner=config.model_id, model_id=config.model_id, max_policy_lag=config.max_policy_lag,
            reward_policy=reward_policy, metrics=metrics,
        )
        reward_ledger = RewardLedger(redis, store, reward_policy, owner=config.model_id)
        publisher = TurnPublisher(registry, store, metered_judge, metrics=metrics, membership=membership)
        rewards = RewardProjector(redis, store)
        repository = LoraRepository(config.lora_repository_path, model_id=config.model_id)
        gateway = _make_gateway_client(config, token, metrics)
        backend = backend or make_backend(config, repository)
        rollout, runner, runs = _make_training(
            config, redis, store, backend, repository, gateway, metrics, fence)
        deps = cls(
            config=config,
            redis=redis,
            registry=registry,
            store=store,
            judge=judge,
            publisher=publisher,
            pipeline=CapturePipeline(
                registry, publisher, turn_publish_timeout_s=config.turn_publish_timeout_seconds
            ),
            lifecycle=TaskLifecycle(
                registry, publisher, model_id=config.model_id, judge_configured=judge is not None
            ),
            rewards=rewards,
            sweeper=_make_retention_sweeper(config, redis, store, rewards, metrics, fence),
            reward_ledger=reward_ledger,
            reward_sweeper=RewardDeadlineSweeper(reward_ledger, fence=fence, interval_s=reward_policy.sweep_interval_s),
            rail=_make_rail_ingestor(config, redis, store, metered_judge, membership),
            repository=repository,
            gateway=gateway,
            backend=backend,
            runner=runner,
            metrics=metrics,
            rollout=rollout,
            membership=membership,
            scheduler=TrainingScheduler(
                redis, runs=runs, runner=runner, store=store, rollout=rollout, pauses=LineagePauses(redis), fence=fence,
                policy=config.training_policy, model_id=config.model_id, max_policy_lag=config.max_policy_lag,
            ),
            fence=fence,
            lineages=LineageRegistry(redis, model_id=config.model_id, runs=runs),
        )
        deps.coordinator = WorkerCoordinator(redis, placement, membership, deps, fence,
                                             leader_check=runner.check_health)
        return deps

    async def claim_owner(self) -> None:
        """Startup step 1: this database belongs to exactly one model id."""
        await self.redis.set(keys.OWNER, self.config.model_id, nx=True)
        owner = await self.redis.get(keys.OWNER)
        if owner is not None and owner.decode() != self.config.model_id:
            raise OwnerMismatch("this Redis database belongs to another model id; refusing to start")

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        try:
            await self.claim_owner()
            await self.coordinator.start()  # alone, or as the first leader of a boot: startup recovery is done
            if not self.coordinator.is_leader:
                await self.recover_worker()
        except Exception as exc:
            log.error("RL service startup failed: %s", exc, exc_info=True)
            await self.coordinator.stop()
            await self.aclose()
            raise
        # Everything allocated so far (modules, app, clients, recovered state) lives for the whole process: frozen
        # out of the collector, and gen 0 collected less often (common/gc_tuning.py). Here, not in main(), so the
        # uvicorn factory gets it too, and once.
        tune_gc()
        log.info("RL service ready for model %s%s", self.config.model_id, "" if self.coordinator.placement.solo
                 else f" (worker {self.coordinator.placement.index} of {self.coordinator.placement.count})")
        try:
            yield
        finally:
            await self.coordinator.stop()
            await self.aclose()

    # ------------------------------------------------------------------ the leader's duties (workers/coordinator.py)

    async def take_office(self, *, first_of_boot: bool) -> None:
        """Startup recovery (a first leader of a boot: Tasks of the previous boot are aborted) or takeover recovery
        (a later leader: the run and rollout the previous leader left), then the singleton loops."""
        if first_of_boot:
            await self.lifecycle.recover(fence=self.fence)
        await self.rewards.resume_interrupted()
        await self.rail.recover()
        await self.rollout.probe()  # canary / manual under a gateway without the canary routes: refuse
        await self.rollout.recover()
        await self.runner.recover()
        # Before the first sweep: ids listed before the per-lineage listing indexes existed get theirs (one-time).
        await ListingBackfill(self.redis, fence=self.fence).run()
        await self.sweeper.sweep_once()
        # Without a policy the reward sweeper runs only to release samples that still wait from a time a policy
        # was configured (their open sources are gone, so each is released at its next deadline).
        self.run_reward_sweeper = self.reward_ledger.policy.configured or await self.reward_ledger.waiting() > 0
        if self.run_reward_sweeper:
            await self.reward_sweeper.sweep_once()
        await self._check_training_root()
        self.sweeper.start()
        self.rollout.start()
        if self.run_reward_sweeper:
            self.reward_sweeper.start()
        self.scheduler.start()  # automatic training (a no-op unless `training_policy.auto`)

    async def leave_office(self, *, shutdown: bool) -> None:
        """Stop the singleton loops. At shutdown the active run is stopped and, once the other workers left, every
        active Task is finished; a leader that lost its lease only drops its executions (the next one settles)."""
        await self.scheduler.stop()  # first: no run may start while the others are being stopped
        await self.reward_sweeper.stop()
        await self.sweeper.stop()
        await self.rollout.stop()
        if not shutdown:
            await self.runner.relinquish()
            return
        await self.runner.shutdown()
        left = await self.coordinator.wait_alone(SHUTDOWN_WAIT_FOR_WORKERS_S)
        if left:
            log.warning("shutdown: %d other worker(s) still running; finishing the active Tasks anyway", left)
        await self.lifecycle.shutdown()

    async def follow(self) -> None:
        """A follower's beat: each line's live canary as Redis has it, so that a Task start here marks its arm."""
        await self.rollout.refresh()

    async def recover_worker(self) -> None:
        """A worker that replaces a dead one finishes what that one may have left half done and nobody else would:
        an interrupted reward projection (idempotent beside a live one) and its in-flight rail samples."""
        await self.rewards.resume_interrupted()
        await self.rail.recover()

    async def _check_training_root(self) -> None:
        """Say at start when `training_tmp_root` is unsafe. Capture keeps working; each Training Run checks the root
        again and fails with the same reason, so a local user who creates the directory first gets no data."""
        try:
            await asyncio.to_thread(ensure_private_root, self.config.training_tmp_root)
        except (UnsafeDirectoryError, OSError) as exc:
            log.error("%s: Training Runs will fail until this is fixed", exc)

    async def aclose(self) -> None:
        await self.backend.close()
        await self.gateway.aclose()
        if self.judge is not None:
            await self.judge.aclose()
        await self.redis.aclose()


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
    store: TrajectoryStore,
    backend: TrainerBackend,
    repository: LoraRepository,
    gateway: GatewayLoraClient,
    metrics: ServiceMetrics,
    fence: Fence,
) -> tuple[RolloutController, TrainingRunner, RunStore]:
    """Training Runs and the rollout of what they produce: the rollout controller, the runner, the run store."""
    runs = RunStore(
        redis, store, model_id=config.model_id, run_retention_s=config.run_retention_seconds, fence=fence,
        metrics=metrics,
    )
    rollout = RolloutController(
        redis, RolloutStore(redis, fence=fence), gateway, repository, config=config.rollout, model_id=config.model_id,
        base_model_path=config.base_model_path, observe_policy=runs.observe_policy, active_run=runs.active,
        metrics=metrics,
    )
    runner = TrainingRunner(
        runs,
        store,
        backend,
        repository,
        gateway,
        model_id=config.model_id,
        base_model_path=config.base_model_path,
        min_samples=config.min_samples_for_training,
        max_samples=config.max_samples_per_run,
        max_policy_lag=config.max_policy_lag,
        tmp_root=config.training_tmp_root,
        metrics=metrics,
        rollout=rollout,
    )
    return rollout, runner, runs


def _make_retention_sweeper(
    config: RLServiceConfig, redis: Redis, store: TrajectoryStore, rewards: RewardProjector, metrics: ServiceMetrics,
    fence: Fence,
) -> RetentionSweeper:
    return RetentionSweeper(
        redis,
        store,
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
    config: RLServiceConfig, redis: Redis, store: TrajectoryStore, judge: "Judge | None", membership: Membership,
) -> RailIngestor:
    recorder = RailRecorder(
        config.record_dir, max_bytes=config.record_max_bytes, backup_count=config.record_backup_count
    )
    return RailIngestor(
        redis, store, judge, model_id=config.model_id, retention_seconds=config.trajectory_retention_seconds,
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
            tmp_root=config.training_tmp_root,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def create_app(
    config: RLServiceConfig | None = None,
    *,
    redis: Redis | None = None,
    judge: "Judge | None" = None,
    backend: TrainerBackend | None = None,
    token: str | None = None,
    placement: Placement | None = None,
) -> FastAPI:
    """The ASGI app. With no arguments (uvicorn factory) the config comes from `RL_SERVICE_CONFIG`, the bearer
    token from `RL_SERVICE_TOKEN`, and the process's fault injection point (chaos tests only) is installed from
    `ONLINE_RL_CRASH_AT` (faults.py; `main` installs it itself).
    `placement`: this process's place in a worker group (workers/); None runs alone."""
    if config is None:
        path = os.environ.get(wire_env.SERVICE_CONFIG)
        if not path:
            raise ConfigError(f"{wire_env.SERVICE_CONFIG} is not set and no config was given")
        config = load_config(path)
        configure_logging(config)
        faults.install_from_env()  # the factory is this process's start
    if token is None:
        token = os.environ.get(wire_env.SERVICE_TOKEN) or None
    deps = ServiceDeps.build(config, redis=redis, judge=judge, backend=backend, token=token, placement=placement)
    app = ServiceApp(
        title="openjiuwen online RL service", lifespan=deps.lifespan, docs_url=None, redoc_url=None,
        redirect_slashes=False,  # `/v1/rl/trajectories/` is an unknown path (404 envelope), not a 307 to the listing
    )
    app.state.deps = deps  # for tests and operators' debugging only; routers get their parts explicitly
    install_error_envelope(app, logger=api_log, on_error=deps.metrics.exception)
    hooks = CaptureHooks(deps.pipeline, deps.metrics)
    app.include_router(build_health_router(
        deps.redis, model_id=config.model_id, extra_checks=[deps.coordinator.check_health],
        on_redis_error=deps.metrics.redis_error,
        workers=None if deps.coordinator.placement.solo else deps.coordinator.snapshot,
    ))
    app.include_router(build_tasks_router(deps.registry, deps.lifecycle, deps.rewards, deps.lineages,
                                          on_created=deps.rollout.task_started))
    app.include_router(build_hooks_router(hooks, deps.lifecycle, deps.registry))
    app.include_router(build_rewards_router(deps.reward_ledger))
    reward_stats = deps.reward_ledger.stats if deps.reward_ledger.policy.configured else None
    app.include_router(build_trajectories_router(deps.store, deps.lineages, reward_stats=reward_stats))
    app.include_router(build_rail_router(deps.rail))
    app.include_router(build_training_router(deps.runner, deps.lineages))
    app.include_router(build_policies_router(PolicyReport(deps.redis, model_id=config.model_id), deps.lineages))
    app.include_router(build_rollout_router(deps.rollout, deps.lineages))
    app.include_router(build_lineages_router(deps.scheduler, deps.lineages))
    # Inside the guards (bearer 401 and size 413 first): a non-JSON body is 415 (a browser's cross-site simple POST).
    app.add_middleware(JsonBodyMiddleware, binary_routes=HOOK_BINARY_ROUTES)
    if not deps.coordinator.placement.solo:  # inside the guards: only an authorised request is relayed
        coordinator = deps.coordinator
        app.add_middleware(LeaderForwarding, is_leader=lambda: coordinator.is_leader, leader=coordinator.leader)
    app.add_middleware(GuardMiddleware, token=token, max_body_bytes=config.max_body_bytes)
    app.include_router(build_metrics_router(deps.metrics, deps.redis, deps.store.stats))
    # Outermost: every answer is counted, the guards' 401/413 included.
    app.add_middleware(HttpMetricsMiddleware, observe=deps.metrics.http)
    # In front of all of it, the hooks' lean path: the same checks, answers and counts as the stack above.
    app.hook_fast_path = HookFastPath(
        hooks,
        guard=RequestGuard(token=token, max_body_bytes=config.max_body_bytes),
        body_types=BodyTypeGuard(HOOK_BINARY_ROUTES),
        unhandled=UnhandledErrors(message=INTERNAL_ERROR_MESSAGE, logger=api_log, on_error=deps.metrics.exception),
        observe=deps.metrics.http,
    )
    return app


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m openjiuwen.agent_evolving.agent_rl.online.service",
        description="Run the online RL Service (started by the gateway; binds loopback only).",
    )
    parser.add_argument(
        "--config", help=f"YAML or JSON config file (default: ${wire_env.SERVICE_CONFIG}); see docs/configuration.md"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    path = args.config or os.environ.get(wire_env.SERVICE_CONFIG)
    if not path:
        print(f"error: pass --config FILE or set {wire_env.SERVICE_CONFIG}", file=sys.stderr)
        return 2
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        faults.install_from_env()  # once, for the whole process: the parts reach their points through faults.py
    except ValueError as exc:
        print(f"error: {CRASH_AT_ENV}: {exc}", file=sys.stderr)
        return 2
    configure_logging(config)
    install_parent_death_watchdog()  # the gateway's child, or a worker of the group (workers/group.py)
    slot = os.environ.get(WORKER_ENV)
    if slot:
        return _serve_worker(config, WorkerSlot.decode(slot))
    if config.worker_count > 1:
        group = WorkerGroup(config_path=path, host=config.listen_host, port=config.listen_port,
                            count=config.worker_count, redis_url=config.redis_url.get_secret_value())
        return group.run()
    return _serve(config, placement=None, sockets=None)


def _serve_worker(config: RLServiceConfig, slot: WorkerSlot) -> int:
    """One worker of a group: the group's shared socket, plus a private loopback one the followers relay
    leader-only requests to (workers/forward.py)."""
    shared = socket.socket(fileno=slot.listen_fd)
    private = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    private.bind(("127.0.0.1", 0))
    placement = Placement(boot=slot.boot, index=slot.slot, count=slot.count, port=private.getsockname()[1])
    return _serve(config, placement=placement, sockets=[shared, private], ready_fd=slot.ready_fd)


def _serve(
    config: RLServiceConfig, *, placement: Placement | None, sockets: list[socket.socket] | None,
    ready_fd: int = -1,
) -> int:
    import uvloop  # hooks are mostly event-loop and socket work: uvloop's loop does it in C

    from ..common.quiet_server import QuietServer

    app = create_app(config, token=os.environ.get(wire_env.SERVICE_TOKEN) or None, placement=placement)
    limits = ConnectionLimits(header_timeout_s=config.http_header_timeout_seconds,
                              keep_alive_s=config.http_keep_alive_seconds,
                              max_connections=config.http_max_connections)
    server = QuietServer(
        server_config(  # raises the soft open-files limit to the hard one first
            app,
            host=config.listen_host,
            port=config.listen_port,
            limits=limits,
            name="rl-service",
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=30,
        )
    )

    async def serve() -> None:
        serving = asyncio.create_task(server.serve(sockets=sockets))
        if ready_fd >= 0:  # a worker tells its group once it serves
            while not server.started and not serving.done():
                await asyncio.wait({serving}, timeout=0.05)
            if server.started:
                os.write(ready_fd, f"{placement.index if placement else 0}\n".encode())
            os.close(ready_fd)
        await serving

    # uvicorn re-raises the SIGTERM it handled once shutdown is done; exit 0 then, not "killed by SIGTERM".
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvloop.run(serve())
    except Exception:
        log.exception("RL service failed")
        return 1
    # uvicorn swallows a lifespan startup failure and just stops: report it as the failure it is.
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
