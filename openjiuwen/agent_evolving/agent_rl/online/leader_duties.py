"""The leader's duties: what one worker of the RL Service runs and only it, while it holds the lease.

The worker coordinator (workers/coordinator.py) calls these under the lease: `take_office` once it won it (startup
or takeover recovery, then the singleton loops), `leave_office` when it loses it or the service stops, `follow` on
a follower's beat. Every Redis write these duties make goes through the term's fence (store/fence.py), so a
deposed leader's late write is refused. The parts are built by assembly.py; this class only runs them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from ..common.private_files import UnsafeDirectoryError, ensure_private_root
from .tasks.lifecycle import TaskLifecycle
from .lineage_lifecycle import LineageLifecycle
from .rewards.projector import RewardProjector
from .rail_ingest.ingest import RailIngestor
from .retention import RetentionSweeper
from .rewards.ledger import RewardLedger
from .rewards.sweeper import RewardDeadlineSweeper
from .rollout.controller import RolloutController
from .rollout.decision_loop import DecisionLoop
from .lineage_backfill import ListingBackfill
from .training.runner import TrainingRunner
from .training.scheduler import TrainingScheduler
from .store.fence import Fence

log = logging.getLogger("openjiuwen.agent_rl.online.service")

# At shutdown the leader finishes the active Tasks only once the other workers left (their servers drained their
# hooks first), waiting at most this long.
SHUTDOWN_WAIT_FOR_WORKERS_S = 35.0


class LeaderDuties:
    """The leader's recovery steps and singleton loops (the coordinator's `Duties`), and a replacing worker's
    recovery of what a dead one left.

    :param wait_alone: waits until the other workers of the boot left, at most the given seconds; returns how
        many are still there (the coordinator's, which is built after these duties).
    """

    def __init__(
        self,
        redis: Redis,
        *,
        fence: Fence,
        lifecycle: TaskLifecycle,
        rewards: RewardProjector,
        rail: RailIngestor,
        rollout: RolloutController,
        rollout_decisions: DecisionLoop,
        runner: TrainingRunner,
        sweeper: RetentionSweeper,
        reward_ledger: RewardLedger,
        reward_sweeper: RewardDeadlineSweeper,
        scheduler: TrainingScheduler,
        lineages: LineageLifecycle,
        training_tmp_root: str,
        wait_alone: Callable[[float], Awaitable[int]],
    ) -> None:
        self._redis = redis
        self._fence = fence
        self._lifecycle = lifecycle
        self._rewards = rewards
        self._rail = rail
        self._rollout = rollout
        self._rollout_decisions = rollout_decisions
        self._runner = runner
        self._sweeper = sweeper
        self._reward_ledger = reward_ledger
        self._reward_sweeper = reward_sweeper
        self._scheduler = scheduler
        self._lineages = lineages
        self._training_tmp_root = training_tmp_root
        self._wait_alone = wait_alone
        self.run_reward_sweeper = False

    async def take_office(self, *, first_of_boot: bool) -> None:
        """Startup recovery (a first leader of a boot: Tasks of the previous boot are aborted) or takeover recovery
        (a later leader: the run and rollout the previous leader left), then the singleton loops."""
        if first_of_boot:
            await self._lifecycle.recover(fence=self._fence)
        await self._rewards.resume_interrupted()
        await self._rail.recover()
        await self._rollout.probe()  # canary / manual under a gateway without the canary routes: refuse
        await self._rollout.recover()
        await self._runner.recover()
        # Before the first sweep: ids listed before the per-lineage listing indexes existed get theirs (one-time).
        await ListingBackfill(self._redis, fence=self._fence).run()
        await self._sweeper.sweep_once()
        # Without a policy the reward sweeper runs only to release samples that still wait from a time a policy
        # was configured (their open sources are gone, so each is released at its next deadline).
        self.run_reward_sweeper = self._reward_ledger.policy.configured or await self._reward_ledger.waiting() > 0
        if self.run_reward_sweeper:
            await self._reward_sweeper.sweep_once()
        await self._check_training_root()
        self._sweeper.start()
        self._rollout_decisions.start()
        if self.run_reward_sweeper:
            self._reward_sweeper.start()
        self._scheduler.start()  # automatic training (a no-op unless `training_policy.auto`)
        # Archive unloads and deletions a previous leader left unfinished, then the idle sweep (docs/lineages.md).
        self._lineages.start()

    async def leave_office(self, *, shutdown: bool) -> None:
        """Stop the singleton loops. At shutdown the active run is stopped and, once the other workers left, every
        active Task is finished; a leader that lost its lease only drops its executions (the next one settles)."""
        await self._scheduler.stop()  # first: no run may start while the others are being stopped
        await self._lineages.stop()
        await self._reward_sweeper.stop()
        await self._sweeper.stop()
        await self._rollout_decisions.stop()
        if not shutdown:
            await self._runner.relinquish()
            return
        await self._runner.shutdown()
        left = await self._wait_alone(SHUTDOWN_WAIT_FOR_WORKERS_S)
        if left:
            log.warning("shutdown: %d other worker(s) still running; finishing the active Tasks anyway", left)
        await self._lifecycle.shutdown()

    async def follow(self) -> None:
        """A follower's beat: each line's live canary as Redis has it, so that a Task start here marks its arm."""
        await self._rollout.refresh()

    async def recover_worker(self) -> None:
        """A worker that replaces a dead one finishes what that one may have left half done and nobody else would:
        an interrupted reward projection (idempotent beside a live one) and its in-flight rail samples."""
        await self._rewards.resume_interrupted()
        await self._rail.recover()

    async def _check_training_root(self) -> None:
        """Say at start when `training_tmp_root` is unsafe. Capture keeps working; each Training Run checks the root
        again and fails with the same reason, so a local user who creates the directory first gets no data."""
        try:
            await asyncio.to_thread(ensure_private_root, self._training_tmp_root)
        except (UnsafeDirectoryError, OSError) as exc:
            log.error("%s: Training Runs will fail until this is fixed", exc)
