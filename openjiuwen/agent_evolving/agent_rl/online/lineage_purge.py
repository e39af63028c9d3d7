"""The removal of a deleted lineage's Redis keys and files (docs/lineages.md "Lifecycle"), in bounded batches.

A deletion is marked first (lineage_lifecycle.py: the lineage's state `deleting` and its member in
`rl:v1:lineages:retiring`, one EXEC): from then on no Task starts, no run claims and no rollout begins on it, its
filtered listings answer 404, and this module empties it, one fenced EXEC of at most `BATCH` records at a time, in an
order that never leaves a record pointing at one already gone:

1. its Tasks with their samples (records, captures, staged samples, turns, timelines, their ids in every Task index,
   and the samples their captures became: hash, index, counters, deadline entry and prompt-block references,
   invariants 4, 5 and P);
2. its line's samples left, status by status (those of Tasks whose records had expired);
3. its Training Runs (records, timelines, listing entries);
4. its rollout records (the rollout listing, read a page at a time: rollouts are few);
5. the per-version aggregates of its line's versions (`policy_stats:<line>:vN`, found in `rl:v1:policy_versions`);
6. its versions in the repository (`<root>/<model_id>/lineages/<lineage>/`), when the operator asked (`remove_files`):
   only a marker of its last version number stays (`retired.json`), so that a lineage of the same name never
   publishes a version name a vLLM instance may still hold with other weights;
7. one last EXEC, WATCHing the line's indexes and the lineage's Task and run indexes (so a straggler written
   meanwhile sends the purge round again): every remaining key of the lineage and its line, its entries in the
   shared hashes and sets, the registry entry with the agent-key count, the state and the marker.

Each step only reads what is left, so a leader that crashes anywhere resumes at the next one from the marker: a batch
is applied whole or not at all, and what is applied is never redone (`faults.py` point `lineage.purge_batch`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from ..common.lineage import line_of
from ..common.wire.task_states import TASK_STATUSES
from . import faults
from .lora.repository import LoraRepository
from .rollout.record import Rollout
from .store import keys
from .store.codec import text
from .store.lineage_listing import RUN_LISTING, TASK_LISTING
from .store.sample_status import ALL_SAMPLE_STATUSES
from .store.sample_deletion import SampleDeletion
from .store.sample_line import SampleLine
from .tasks.task_keys import keys_of_tasks
from .store.fence import Fence

log = logging.getLogger("openjiuwen.agent_rl.online.lineages")

BATCH = 200  # records per EXEC: a Task is about 15 keys, so an EXEC stays a few thousand commands at most
_ROLLOUT_PAGE = 200
_GLOB_SPECIAL = "*?[]\\"
_REWARD_ARRIVED = "reward_arrived:"


class LineagePurge:
    def __init__(self, redis: Redis, line: SampleLine, deletion: SampleDeletion, repository: LoraRepository, *,
                 model_id: str, fence: Fence) -> None:
        self._redis, self._line, self._deletion, self._repository = redis, line, deletion, repository
        self._model_id, self._fence = model_id, fence

    async def run(self, lineage: str, *, remove_files: bool) -> dict[str, int]:
        """Empty a lineage marked `deleting` and remove it; returns what each step removed. Idempotent."""
        removed = {"tasks": 0, "samples": 0, "runs": 0, "rollouts": 0, "versions": 0}
        while True:
            removed["tasks"] += await self._tasks(lineage)
            removed["samples"] += await self._samples(lineage)
            removed["runs"] += await self._runs(lineage)
            removed["rollouts"] += await self._rollouts(lineage)
            removed["versions"] += await self._versions(lineage)
            if remove_files:
                await asyncio.to_thread(self._remove_files, lineage)
            if await self._finish(lineage):
                return removed

    # ------------------------------------------------------------------ batches

    async def _batches(self, index: str, remove: Callable[[list[str]], Awaitable[None]]) -> int:
        """Remove the ids at the head of `index`, `BATCH` at a time, until it is empty."""
        total = 0
        while ids := [text(m) or "" for m in await self._redis.zrange(index, 0, BATCH - 1)]:
            await remove(ids)
            total += len(ids)
            faults.reached("lineage.purge_batch")
        return total

    async def _tasks(self, lineage: str) -> int:
        line = self._line.for_line(line_of(self._model_id, lineage))

        async def remove(ids: list[str]) -> None:
            found = await keys_of_tasks(self._redis, ids)
            owned = [key for task in found for key in task.keys]
            # A Task's samples are its captures (sample id = capture id), on its lineage's line.
            captured = [c for task in found for c in task.captures]

            async def body(pipe: Pipeline) -> None:
                samples = [row for row in await self._deletion.rows_to_delete(captured) if row is not None]
                pipe.multi()
                # A Task leaves with every key it owns, every index that lists it and its samples, in one EXEC: no
                # listing names a Task that is gone, no sample names a Task that is gone (invariant 4), and the
                # lineage's indexes lose it with the overall ones.
                pipe.delete(*owned)
                for index in (keys.TASKS_BY_CREATION, *(keys.tasks_by_status(s) for s in TASK_STATUSES),
                              keys.TASKS_LISTING_EXPIRY, keys.TASKS_GC, keys.TASKS_AWAITING_REWARD):
                    pipe.zrem(index, *ids)
                pipe.srem(keys.ACTIVE_TASKS, *ids)
                TASK_LISTING.queue_forget(pipe, ids, [lineage] * len(ids))
                self._deletion.queue_delete(line, pipe, samples)
                await pipe.execute()

            await self._fence.transact(self._redis, body, *(keys.traj(c) for c in captured))

        return await self._batches(keys.tasks_by_lineage(lineage), remove)

    async def _samples(self, lineage: str) -> int:
        line = self._line.for_line(line_of(self._model_id, lineage))
        total = 0
        for status in ALL_SAMPLE_STATUSES:
            async def remove(ids: list[str], status: str = status) -> None:
                await self._deletion.delete_in_status(line, status, ids, self._fence)

            total += await self._batches(line.index_key(status), remove)
        return total

    async def _runs(self, lineage: str) -> int:
        async def remove(ids: list[str]) -> None:
            def queue(pipe: Pipeline) -> None:
                pipe.delete(*(keys.training_run(r) for r in ids), *(keys.training_run_events(r) for r in ids))
                pipe.zrem(keys.RUNS_BY_CREATION, *ids)
                pipe.zrem(keys.RUNS_LISTING_EXPIRY, *ids)
                RUN_LISTING.queue_forget(pipe, ids, [lineage] * len(ids))

            await self._fence.write(self._redis, queue)

        return await self._batches(keys.runs_by_lineage(lineage), remove)

    async def _rollouts(self, lineage: str) -> int:
        """The lineage's rollout records: the listing holds every line's, so it is read a page at a time (a deletion
        is a rare operator action, and there is at most one rollout per Training Run)."""
        total, start = 0, 0
        while page := [text(m) or "" for m in
                       await self._redis.zrange(keys.ROLLOUTS_BY_CREATION, start, start + _ROLLOUT_PAGE - 1)]:
            raws = await self._redis.mget([keys.rollout(r) for r in page])
            ours = [r for r, raw in zip(page, raws) if raw is not None and Rollout.from_json(raw).lineage == lineage]
            if ours:
                def queue(pipe: Pipeline) -> None:
                    pipe.delete(*(keys.rollout(r) for r in ours), *(keys.rollout_events(r) for r in ours))
                    pipe.zrem(keys.ROLLOUTS_BY_CREATION, *ours)

                await self._fence.write(self._redis, queue)
                total += len(ours)
                faults.reached("lineage.purge_batch")
            start += len(page) - len(ours)
        return total

    async def _versions(self, lineage: str) -> int:
        """The aggregates of the line's versions (`<line>:vN`): the shared version set is scanned with a pattern."""
        line = line_of(self._model_id, lineage)
        pattern = "".join(f"\\{c}" if c in _GLOB_SPECIAL else c for c in line) + ":v*"
        found = [text(m) or "" async for m in self._redis.sscan_iter(keys.POLICY_VERSIONS, match=pattern, count=500)]
        ours = [v for v in dict.fromkeys(found) if v.startswith(f"{line}:v") and v[len(line) + 2:].isdigit()]
        for start in range(0, len(ours), BATCH):
            chunk = ours[start:start + BATCH]

            def queue(pipe: Pipeline, chunk: list[str] = chunk) -> None:
                pipe.delete(*(keys.policy_stats(v) for v in chunk))
                pipe.srem(keys.POLICY_VERSIONS, *chunk)

            await self._fence.write(self._redis, queue)
            faults.reached("lineage.purge_batch")
        return len(ours)

    def _remove_files(self, lineage: str) -> None:
        # Its versions go; the number of its last one stays, so a new lineage of the name never reuses a version name.
        self._repository.for_line(line_of(self._model_id, lineage)).retire_sync()

    # ------------------------------------------------------------------ the last step

    async def _finish(self, lineage: str) -> bool:
        """Remove what is left in one EXEC once the lineage holds no record; False when a straggler appeared."""
        line = self._line.for_line(line_of(self._model_id, lineage))
        indexes = [line.index_key(status) for status in ALL_SAMPLE_STATUSES]
        task_indexes = [keys.tasks_by_lineage(lineage), *(keys.tasks_by_lineage_status(lineage, s)
                                                           for s in TASK_STATUSES)]
        run_index = keys.runs_by_lineage(lineage)
        watched = [*indexes, *task_indexes, run_index, line.stats_key, keys.lineage_state(lineage)]

        async def body(pipe: Pipeline) -> bool:
            counts = [await pipe.zcard(index) for index in (*indexes, keys.tasks_by_lineage(lineage), run_index)]
            if any(counts):
                return False
            sources = [f[len(_REWARD_ARRIVED):] for f in (text(k) or "" for k in await pipe.hkeys(line.stats_key))
                       if f.startswith(_REWARD_ARRIVED)]
            registrar = text(await pipe.hget(keys.LINEAGES_REGISTERED_BY, lineage))
            pipe.multi()
            # The lineage leaves the registry with its last keys: the registry never names a lineage without its
            # state, and an agent key's count drops with the lineage it registered (keys.LINEAGES_COUNT_BY_KEY).
            pipe.delete(*indexes, *task_indexes, run_index, line.stats_key, line.deadlines_key,
                        *(keys.reward_latency(line.owner, s) for s in sources if _is_source(s)),
                        keys.rollout_current(lineage), keys.lineage_state(lineage))
            for shared in (keys.REWARD_DUE_LINES, keys.TRAINING_WAITING):
                pipe.zrem(shared, line.owner)
            pipe.hdel(keys.TRAINING_LAST_END, line.owner)
            pipe.hdel(keys.ELIGIBLE_SINCE, line.owner)
            pipe.hdel(keys.FAIR_SHARE, lineage)
            pipe.hdel(keys.POLICY_OBSERVED_LINES, line.owner)
            pipe.hdel(keys.LINEAGES_PAUSED, lineage)
            pipe.srem(keys.ROLLOUT_LIVE_LINEAGES, lineage)
            pipe.srem(keys.TRAJ_USERS, line.owner)
            for registry in (keys.LINEAGES, keys.LINEAGES_LAST_TASK, keys.LINEAGES_RETIRING):
                pipe.zrem(registry, lineage)
            if registrar is not None:
                pipe.hdel(keys.LINEAGES_REGISTERED_BY, lineage)
                pipe.hincrby(keys.LINEAGES_COUNT_BY_KEY, registrar, -1)
            await pipe.execute()
            return True

        done = await self._fence.transact(self._redis, body, *watched)
        if done:
            log.info("lineage %s deleted", lineage)
        return done


def _is_source(name: str) -> bool:
    try:
        keys.reward_latency("x", name)
    except ValueError:
        return False
    return True
