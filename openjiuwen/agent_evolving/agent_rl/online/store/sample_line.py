"""One line's sample keys and the queued writes every status change shares (CONTRACT §5.2, docs/lineages.md).

A sample lives in `traj:{id}` (index fields, `sample_json`, the packed arrays; its prompt as shared
`prompt_block:{digest}` blocks named by `prompt_blocks` plus the tail in `prompt_ids`, see `prompt_blocks.py`), its
id in exactly one `traj_idx:{owner}:{status}` ZSET, and `traj_stats:{owner}` counts it under `status:<s>`,
`source:<src>` and, while pending, `pending_policy:<version>`. Every status move changes hash, indexes and counters in
one EXEC (invariant 5), so the stats route never scans. `queue_move` is the one place that spells such a move; the
publication, the rewards, the exclusion and the training side reuse it.
"""

from __future__ import annotations

from redis.asyncio.client import Pipeline

from ...common.lineage import DEFAULT_LINEAGE, line_of, split_line
from . import keys
from .reward_view import RewardRules
from .sample_status import SAMPLE_TRANSITIONS, SampleStatus


class SampleLine:
    """The samples of one owner: the service `model_id` (the default lineage's line), or, through `for_line`, the
    line `<model_id>:<lineage>` of another lineage (docs/lineages.md), whose samples have their own status indexes and
    counters (`traj_idx:{line}:…`, `traj_stats:{line}`), so a run of a line claims from its own index. Key names and
    queued writes only: no I/O."""

    def __init__(self, *, owner: str, model_id: str, reward_policy: RewardRules | None = None) -> None:
        self._owner = owner
        self._model_id = model_id
        # With a configured reward policy, publication starts each sample's reward state and may park it in
        # `awaiting_rewards` (docs/rewards.md); without one every published sample is `pending` at once.
        self._root_policy = reward_policy if reward_policy is not None and reward_policy.configured else None
        self._stats_key = keys.traj_stats(owner)  # validates the owner once
        self._deadlines_key = keys.reward_deadlines(owner)
        # This line's lineage: `default` for the service's own owner, else the lineage of the line it was made for.
        self.lineage = DEFAULT_LINEAGE if owner == model_id else split_line(owner)[1]
        # The line's own reward policy (`reward_policy.lineages.<name>`, else the top-level one).
        self._reward_policy = self._root_policy.for_lineage(self.lineage) if self._root_policy is not None else None
        self._lines: dict[str, SampleLine] = {}

    def for_line(self, line: str) -> "SampleLine":
        """The line `line` of this model (this one for its own line). Cheap: key names only."""
        if line == self._owner or (line == self._model_id and self.lineage == DEFAULT_LINEAGE):
            return self
        found = self._lines.get(line)
        if found is None:
            split_line(line)  # refuses a malformed line before it names keys
            found = SampleLine(owner=line, model_id=self._model_id, reward_policy=self._root_policy)
            self._lines[line] = found
        return found

    def for_lineage(self, lineage: str | None) -> "SampleLine":
        return self.for_line(line_of(self._model_id, lineage or DEFAULT_LINEAGE))

    @property
    def owner(self) -> str:
        return self._owner

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def reward_policy(self) -> RewardRules | None:
        """The reward policy this line's samples follow (None without a configured policy)."""
        return self._reward_policy

    @property
    def deadlines_key(self) -> str:
        return self._deadlines_key

    @property
    def stats_key(self) -> str:
        return self._stats_key

    def index_key(self, status: str) -> str:
        return keys.traj_index(self._owner, status)

    def queue_deadline(self, pipe: Pipeline, sample_id: str, deadline: float) -> None:
        """Queue, in a caller's MULTI, a sample's deadline entry; for a non-default line also lower the line's entry
        in `REWARD_DUE_LINES` to it, in the same EXEC, so that hint stays at or below the line's earliest deadline."""
        pipe.zadd(self._deadlines_key, {sample_id: deadline})
        if self.lineage != DEFAULT_LINEAGE:
            pipe.zadd(keys.REWARD_DUE_LINES, {self._owner: deadline}, lt=True)

    def queue_waiting(self, pipe: Pipeline, created_at: float) -> None:
        """Queue, in the caller's MULTI that puts a sample of creation epoch `created_at` into this line's pending
        index, the lowering of the line's `TRAINING_WAITING` entry to it (non-default lines only): the line is due
        for the scheduler's judgement now, whatever it was judged before (the invariant in keys.py)."""
        if self.lineage != DEFAULT_LINEAGE:
            pipe.zadd(keys.TRAINING_WAITING, {self._owner: created_at}, lt=True)

    def queue_move(
        self,
        pipe: Pipeline,
        sample_id: str,
        *,
        old: str,
        new: str,
        score: float,
        policy_version: str,
        at: str,
        run_id: str | None = None,
    ) -> None:
        """Queue, inside a caller's MULTI, the writes of one status move (`pending → training`, `training →
        trained | failed`, `training → pending`, `awaiting_rewards → pending`): hash `status`/`updated_at` (and
        `run_id`), index membership and the counters, so the caller's EXEC keeps invariant 5. `score` is
        `created_at` epoch for `pending`, the transition time otherwise. The caller WATCHes the hash and checked that
        its status is `old`; a move the sample table (`sample_status.py`) forbids raises IllegalTransition."""
        SAMPLE_TRANSITIONS.check(old, new)
        mapping: dict[str, str] = {"status": new, "updated_at": at}
        if run_id is not None:
            mapping["run_id"] = run_id
        pipe.hset(keys.traj(sample_id), mapping=mapping)
        pipe.zrem(self.index_key(old), sample_id)
        pipe.zadd(self.index_key(new), {sample_id: score})
        pipe.hincrby(self._stats_key, keys.stats_status(old), -1)
        pipe.hincrby(self._stats_key, keys.stats_status(new), +1)
        if old == SampleStatus.PENDING:
            pipe.hincrby(self._stats_key, keys.stats_pending_policy(policy_version), -1)
        if new == SampleStatus.PENDING:
            pipe.hincrby(self._stats_key, keys.stats_pending_policy(policy_version), +1)
            self.queue_waiting(pipe, score)  # `score` is the sample's creation epoch here
        # `source:<src>` counts samples of every status, so a move leaves it alone.

    def queue_counters(self, pipe: Pipeline, status: str, source: str, policy_version: str, delta: int) -> None:
        """Queue the counter changes of a sample of `status` entering (+1) or leaving (-1) the line."""
        pipe.hincrby(self._stats_key, keys.stats_status(status), delta)
        pipe.hincrby(self._stats_key, keys.stats_source(source), delta)
        if status == SampleStatus.PENDING:
            pipe.hincrby(self._stats_key, keys.stats_pending_policy(policy_version), delta)

