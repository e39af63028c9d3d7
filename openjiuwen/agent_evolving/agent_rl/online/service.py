"""RL Service process entry: the one place that reads the environment; it wires the parts (assembly.py), builds the
app from them and serves it.

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
from functools import partial
from typing import TYPE_CHECKING

from fastapi import FastAPI
from redis.asyncio import Redis

from ..common.content_type import BodyTypeGuard, JsonBodyMiddleware
from ..common.errors import INTERNAL_ERROR_MESSAGE, UnhandledErrors, install_error_envelope
from ..common.gc_tuning import tune_gc
from ..common.request_guards import GuardMiddleware, RequestGuard
from ..common.slow_clients import ConnectionLimits, server_config
from ..common.http_metrics import HttpMetricsMiddleware
from ..common.wire import env as wire_env
from . import faults
from .api.hook_fast_path import HookFastPath, ServiceApp
from .api.health import build_health_router
from .api.capture_hooks import BINARY_ROUTES as HOOK_BINARY_ROUTES, CaptureHooks, build_hooks_router
from .api.lineages import build_lineages_router
from .api.metrics import build_metrics_router
from .api.policies import build_policies_router
from .api.rail import build_rail_router
from .api.rewards import build_rewards_router
from .api.rollout import build_rollout_router
from .api.tasks import build_tasks_router
from .api.training import build_training_router
from .api.trajectories import build_trajectories_router
from .config import ConfigError, RLServiceConfig, load_config
from .faults import CRASH_AT_ENV
from .logs import configure_logging
from .version_report import PolicyReport
from .training.backends import TrainerBackend
from .watchdog import install_parent_death_watchdog
from .assembly import ServiceDeps
from .workers.coordinator import Placement
from .workers.forward import LeaderForwarding
from .workers.group import WORKER_ENV, WorkerGroup, WorkerSlot

if TYPE_CHECKING:
    from .judge import Judge

log = logging.getLogger("openjiuwen.agent_rl.online.service")
api_log = logging.getLogger("openjiuwen.agent_rl.online.api")  # unhandled route errors


@asynccontextmanager
async def _lifespan(deps: ServiceDeps, _: FastAPI) -> AsyncIterator[None]:
    """Connect and recover before serving (every worker claims the owner; the leader's duties start under the
    lease), then stop the duties and close the clients."""
    try:
        await deps.claim_owner()
        await deps.coordinator.start()  # alone, or as the first leader of a boot: startup recovery is done
        if not deps.coordinator.is_leader:
            await deps.duties.recover_worker()
    except Exception as exc:
        log.error("RL service startup failed: %s", exc, exc_info=True)
        await deps.coordinator.stop()
        await deps.aclose()
        raise
    # Everything allocated so far (modules, app, clients, recovered state) lives for the whole process: frozen
    # out of the collector, and gen 0 collected less often (common/gc_tuning.py). Here, not in main(), so the
    # uvicorn factory gets it too, and once.
    tune_gc()
    log.info("RL service ready for model %s%s", deps.config.model_id, "" if deps.coordinator.placement.solo
             else f" (worker {deps.coordinator.placement.index} of {deps.coordinator.placement.count})")
    try:
        yield
    finally:
        await deps.coordinator.stop()
        await deps.aclose()


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
        title="openjiuwen online RL service", lifespan=partial(_lifespan, deps), docs_url=None, redoc_url=None,
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
    samples = deps.samples
    app.include_router(build_trajectories_router(
        samples.line, deps.lineages, stats=samples.stats, listing=samples.listing, documents=samples.documents,
        exclusion=samples.exclusion, reward_stats=reward_stats,
    ))
    app.include_router(build_rail_router(deps.rail))
    app.include_router(build_training_router(deps.runner, deps.lineages))
    app.include_router(build_policies_router(PolicyReport(deps.redis, model_id=config.model_id), deps.lineages))
    app.include_router(build_rollout_router(deps.rollout, deps.lineages))
    app.include_router(build_lineages_router(deps.scheduler, deps.lineages, deps.lineage_lifecycle))
    # Inside the guards (bearer 401 and size 413 first): a non-JSON body is 415 (a browser's cross-site simple POST).
    app.add_middleware(JsonBodyMiddleware, binary_routes=HOOK_BINARY_ROUTES)
    if not deps.coordinator.placement.solo:  # inside the guards: only an authorised request is relayed
        coordinator = deps.coordinator
        app.add_middleware(LeaderForwarding, is_leader=lambda: coordinator.is_leader, leader=coordinator.leader)
    app.add_middleware(GuardMiddleware, token=token, max_body_bytes=config.max_body_bytes)
    app.include_router(build_metrics_router(deps.metrics, deps.redis, partial(samples.stats.stats, samples.line)))
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
