"""Invariant checker of the RL Service's Redis state (CONTRACT §5.4), for tests and benchmarks.

After any scenario (faults, bad input, load) it reads the whole key space of one service database and checks:

- keys: no key outside `rl:v1:`, and every key has one of the shapes of CONTRACT §5.2 (`KEY_SHAPES`);
- samples (inv. 5): each sample id is in exactly one status index, matching its hash `status`; every counter of
  `traj_stats` (`status:*`, `source:*`, `pending_policy:*`) equals what the hashes and indexes hold;
- lineages (docs/lineages.md): status indexes and counters exist only for the default line (the model id) and the
  lines `<model_id>:<lineage>` of registered lineages; a sample sits in its own line's index only (its hash `lineage`,
  absent = default) and each line's counters equal what its indexes hold; a run's batch holds only samples of the
  run's lineage; lifecycle (docs/lineages.md "Lifecycle"): states, the retiring marker and the idle clock name
  registered lineages only, every deletion is marked, and each agent key's count equals the lineages it registered;
- runs (inv. 6, per line): every non-terminal run is named by its lineage's pointer (`training_run:active` for
  `default`, the lineage's field of `training_runs:active_lineages` else) and every pointer names a non-terminal run
  of its lineage, so a lineage has at most one; at most `max_concurrent_runs` are live (with a `training_policy`);
  every claimed (`training`) sample belongs to the live run of its own line and is listed in its batch; an
  `outdated` sample was never claimed;
- Tasks (inv. 1–3): the active index, the session pointers and the records agree; `captures` = open ∪ committed
  and the two are disjoint, each member has its metadata with the matching status; a terminal Task has no open
  capture; a staged sample exists only for a committed capture whose Task still may publish it;
- samples of Tasks (inv. 4): every committed capture of a published turn or of a rewarded Task is exactly its
  samples of that Task (one; one per choice of an `n` > 1 answer: the capture id, then `<id>.1` …, as many as its
  metadata's `samples`), and every Task sample comes from such a capture (nothing published from nowhere);
- evaluation Tasks: a sample is `evaluation` exactly when its Task is an evaluation Task, and an `evaluation` sample
  was never claimed (no `run_id`): evaluation traffic is never trained on;
- automatic training (keys.TRAINING_WAITING, the due index): entries name registered lineages' lines only; with a
  `training_policy` (the service's `training_policy` section) every non-default line with pending samples that
  could become eligible by time alone (automatic training on for it, not paused, at its threshold, or at its floor
  with a `max_wait_seconds`, live) has an entry; fair-share tags and `eligible_since` name lineages / lines only;
- excluded instances (inv. 11): no sample an excluded instance served is `pending` or `awaiting_rewards`, and every
  `excluded` sample was served by an excluded instance or carries a constraint `exclusion` (issue 35), which only
  `excluded` samples carry;
- prompt blocks (invariant P, `store/prompt_blocks.py`): a block exists iff some sample references it, its `refs`
  equals the number of referencing samples, it holds exactly one block of ids, the chained digests of each sample
  match the contents, and no block has a TTL;
- TTLs (inv. 8): none on active Tasks, pending/claimed samples, staged samples awaiting a reward, the live runs;
- the client's view (`ClientRecord`, optional): every capture the client saw committed (204) in a Task whose
  reward (200) or turn publication it saw acknowledged is exactly one sample with that reward / a Judge score, and
  the acknowledged `sample_count` equals the samples of the Task's committed captures.

    report = await check_invariants(redis, model_id="tiny", sent=record)   # raises InvariantViolation
    report = await check_invariants(redis, model_id="tiny", raise_on_violation=False)
    assert report.ok, report.describe()

Sample statuses come from `ALL_SAMPLE_STATUSES` (`awaiting_rewards` included: its deadline index holds exactly
those samples, each with its per-source state); listings hold each Task under its own status; `CLAIMED_STATUSES`
names those that must belong to a live run.
Only reads: the checker never writes, deletes or flushes anything. Cost: one SCAN plus pipelined reads of index
fields, about 1.6 s for 20 000 samples on the 2-core development machine (documents are read only for the samples
a ClientRecord vouches for).
"""

from __future__ import annotations

import math
import re
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis.asyncio import Redis

from openjiuwen.agent_evolving.agent_rl.common.lineage import DEFAULT_LINEAGE, line_of, parse_version_name, split_line
from openjiuwen.agent_evolving.agent_rl.online.store import keys, prompt_blocks
from openjiuwen.agent_evolving.agent_rl.online.store.sample_status import ALL_SAMPLE_STATUSES, SampleStatus
from openjiuwen.agent_evolving.agent_rl.online.store.codec import decode_meta
from openjiuwen.agent_evolving.agent_rl.online.training.training_policy import TrainingPolicyConfig

PREFIX = keys.PREFIX
CLAIMED_STATUSES = ("training",)  # statuses whose samples belong to a live run of their line
NO_TTL_STATUSES = (SampleStatus.AWAITING_REWARDS, "pending", "training")  # samples that must never expire
TERMINAL_RUN_STATUSES = ("succeeded", "failed", "canceled")
_READ_BATCH = 500

_T = r"[A-Za-z0-9_-]{1,64}"  # rl_task_id
_I = r"[A-Za-z0-9._:-]{1,128}"  # session, capture, turn ids
_S = r"[A-Za-z0-9._:-]{1,300}"  # sample ids (rail: `<trajectory_id>:<step>`)
_O = r"[^\s]+"  # owner = model id
_R = r"run-[0-9a-f]{12}"
_P = re.escape(PREFIX)

# Every key shape of CONTRACT §5.2; a new key family is added here with its section of the contract.
KEY_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(_P + pattern))
    for name, pattern in (
        ("owner", "owner"),
        ("active_tasks", "tasks:active"),
        ("awaiting_reward", "tasks:awaiting_reward"),
        ("tasks_gc", "tasks:gc"),
        ("traj_users", "traj_users"),
        ("policy_observed", "policy:observed"),
        ("policy_observed_lines", "policy:observed_lines"),
        ("active_run", "training_run:active"),
        ("active_lineage_runs", "training_runs:active_lineages"),
        ("active_session", f"active_session:{_I}"),
        ("task", f"task:(?P<t>{_T})"),
        ("capture", f"task:(?P<t>{_T}):capture:(?P<c>{_I})"),
        ("captures", f"task:(?P<t>{_T}):captures"),
        ("open_captures", f"task:(?P<t>{_T}):captures:open"),
        ("committed_captures", f"task:(?P<t>{_T}):captures:committed"),
        ("turn_current", f"task:(?P<t>{_T}):turn:current"),
        ("turn_transition", f"task:(?P<t>{_T}):turn:transition"),
        ("turns_closed", f"task:(?P<t>{_T}):turns:closed"),
        ("turn_captures", f"task:(?P<t>{_T}):turn:(?P<u>{_I}):captures"),
        ("turn_publish", f"task:(?P<t>{_T}):turn:(?P<u>{_I}):publish"),
        ("turn_publisher", f"task:(?P<t>{_T}):turn:(?P<u>{_I}):publisher"),
        ("staged", f"task:(?P<t>{_T}):pending:(?P<c>{_I})"),
        ("reward", f"task:(?P<t>{_T}):reward"),
        ("task_events", f"task:(?P<t>{_T}):events"),
        ("traj", f"traj:(?P<s>{_S})"),
        ("prompt_block", "prompt_block:(?P<b>[0-9a-f]{32})"),
        ("traj_index", f"traj_idx:(?P<o>{_O}):(?P<status>[a-z_]+)"),
        ("traj_stats", f"traj_stats:(?P<o>{_O})"),
        ("pending_judge", f"pending_judge:{_I}:{_I}:[0-9]+"),
        ("pending_judge_session", f"pending_judge_session:{_I}"),
        ("rail_inflight_sessions", "rail:inflight_sessions"),
        ("rail_inflight", f"rail:inflight:(?P<rs>{_I})"),
        ("rail_inflight_owners", "rail:inflight_owners"),
        ("run", f"training_run:(?P<r>{_R})"),
        ("run_events", f"training_run:(?P<r>{_R}):events"),
        # Automatic training (docs/training.md): each line's previous run end, the operator's lineage pauses.
        ("training_last_end", "training:last_end"),
        ("lineages_paused", "lineages:paused"),
        # Lineages (docs/lineages.md): every registered lineage but `default`.
        ("lineages", "lineages"),
        # Lineage lifecycle (docs/lineages.md "Lifecycle"): the idle clock, the unload / deletion marker, the
        # agent-key cap's bookkeeping, and each archived or deleting lineage's state.
        ("lineages_last_task", "lineages:last_task"),
        ("lineages_retiring", "lineages:retiring"),
        ("lineages_registered_by", "lineages:registered_by"),
        ("lineages_count_by_key", "lineages:count_by_key"),
        ("lineage_state", "lineage:(?P<lineage>[a-z0-9-]{1,63}):state"),
        # Listings (docs/observability.md): creation-ordered indexes and the expiry index that trims them.
        ("tasks_by_created", "tasks:by_created"),
        ("tasks_by_status", "tasks:by_created:(?P<ts>active|finalized|aborted)"),
        ("tasks_listing_expiry", "tasks:listing_expiry"),
        ("runs_by_created", "training_runs:by_created"),
        ("runs_listing_expiry", "training_runs:listing_expiry"),
        # Listings per lineage (docs/lineages.md): each lineage's own indexes, the lineage of expiring records.
        ("tasks_by_lineage", "tasks:by_lineage:(?P<lineage>[a-z0-9-]{1,63})"),
        ("tasks_by_lineage_status", "tasks:by_lineage:(?P<lineage>[a-z0-9-]{1,63}):(?P<ts>active|finalized|aborted)"),
        ("tasks_listing_lineage", "tasks:listing_lineage"),
        ("runs_by_lineage", "training_runs:by_lineage:(?P<lineage>[a-z0-9-]{1,63})"),
        ("runs_listing_lineage", "training_runs:listing_lineage"),
        ("listings_lineage_backfill", "listings:lineage_backfill"),
        # Per-version evaluation aggregates (docs/observability.md).
        ("policy_versions", "policy_versions"),
        # Instances an operator excluded from training (issue 28 item 2).
        ("excluded_instances", "excluded_instances"),
        ("policy_stats", f"policy_stats:{_I}"),
        # Reward policy (docs/rewards.md): deadline index of awaiting_rewards samples, arrival lateness per source.
        ("reward_deadlines", f"reward_deadlines:(?P<o>{_O})"),
        ("reward_latency", f"reward_latency:(?P<o>{_O}):[a-z0-9_-]{{1,32}}"),
        # Lines of lineages with a reward deadline (a lower bound of each line's earliest one).
        ("rewards_due_lines", "rewards:due_lines"),
        # Lines of lineages with pending samples (training/scheduler.py): a lower bound of each one's oldest.
        ("training_waiting", "training:waiting"),
        ("fair_share", "training:fair_share"),
        ("eligible_since", "training:eligible_since"),
        # Rollouts (docs/rollout.md): the current pointer, the listing, records and their timelines.
        ("rollout_current", "rollout:current"),
        ("rollouts_by_created", "rollouts:by_created"),
        # Rollouts per line (docs/lineages.md): a lineage's own pointer, and the lineages with one.
        ("lineage_rollout_current", "lineage:(?P<lineage>[a-z0-9-]{1,63}):rollout:current"),
        ("rollouts_live_lineages", "rollouts:live_lineages"),
        ("rollout", "rollout:(?P<ro>ro-[0-9a-f]{12})"),
        ("rollout_events", "rollout:(?P<ro>ro-[0-9a-f]{12}):events"),
        # Worker processes (CONTRACT §2.11): the leader lease, its epoch, the recovered boot, heartbeats, the fault.
        ("service_leader", "service:leader"),
        ("service_leader_epoch", "service:leader_epoch"),
        ("service_recovered_boot", "service:recovered_boot"),
        ("service_workers", "service:workers"),
        ("service_leader_fault", "service:leader_fault"),
    )
)


class InvariantViolation(AssertionError):
    """One or more invariants failed; the message lists every violation."""


@dataclass
class ClientRecord:
    """What a client (test, benchmark, chaos workload) was told by the service, to compare with the stored state.

    Record only acknowledged outcomes: a 201 start, a 204 `:after`, a 200 stop / reward, a turn known published
    (the 200 `:before` of the next turn, or the 200 stop of a delayed Task). Safe to share between coroutines."""

    tasks: dict[str, str] = field(default_factory=dict)  # rl_task_id -> reward_mode
    committed: dict[str, dict[str, str | None]] = field(default_factory=lambda: defaultdict(dict))  # t -> c -> turn
    finalized: set[str] = field(default_factory=set)
    rewards: dict[str, tuple[float, int]] = field(default_factory=dict)  # t -> (reward, acknowledged sample_count)
    published_turns: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def task_started(self, rl_task_id: str, reward_mode: str = "terminal") -> None:
        self.tasks[rl_task_id] = reward_mode

    def capture_committed(self, rl_task_id: str, capture_id: str, turn: str | None = None) -> None:
        self.committed[rl_task_id][capture_id] = turn

    def task_finalized(self, rl_task_id: str) -> None:
        self.finalized.add(rl_task_id)

    def reward_acknowledged(self, rl_task_id: str, reward: float, sample_count: int) -> None:
        self.rewards[rl_task_id] = (float(reward), int(sample_count))

    def turn_published(self, rl_task_id: str, turn: str) -> None:
        self.published_turns[rl_task_id].add(turn)

    @property
    def expected_samples(self) -> int:
        """Samples the client can prove must exist: committed captures of rewarded Tasks and published turns."""
        n = sum(len(self.committed.get(t, {})) for t in self.rewards)
        for t, turns in self.published_turns.items():
            n += sum(1 for turn in self.committed.get(t, {}).values() if turn in turns)
        return n


@dataclass
class InvariantReport:
    violations: list[str] = field(default_factory=list)
    keys: int = 0
    samples: int = 0
    samples_by_status: dict[str, int] = field(default_factory=dict)
    tasks: int = 0
    captures: int = 0
    runs: int = 0
    client_samples_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, message: str) -> None:
        self.violations.append(message)

    def describe(self, limit: int = 50) -> str:
        head = (f"{len(self.violations)} invariant violation(s) over {self.keys} keys, {self.samples} samples, "
                f"{self.tasks} tasks, {self.runs} runs")
        lines = self.violations[:limit]
        more = [f"... and {len(self.violations) - limit} more"] if len(self.violations) > limit else []
        return "\n  ".join([head, *lines, *more])

    def summary(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "violations": len(self.violations), "keys": self.keys, "samples": self.samples,
            # str(): JSON object keys
            "samples_by_status": {str(status): n for status, n in self.samples_by_status.items()},
            "tasks": self.tasks, "captures": self.captures,
            "runs": self.runs, "client_samples_checked": self.client_samples_checked,
        }


def classify_key(key: str) -> tuple[str, dict[str, str]] | None:
    """(shape name, named groups) of a service key, or None when it has no known shape."""
    for name, pattern in KEY_SHAPES:
        m = pattern.fullmatch(key)
        if m:
            return name, m.groupdict()
    return None


def _s(raw: bytes | str | None) -> str | None:
    if raw is None:
        return None
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def _json(raw: bytes | str | None) -> Any:
    if raw is None:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _UNDECODABLE


_UNDECODABLE = object()


def _chunks(items: Sequence[Any], n: int = _READ_BATCH) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


async def _pipelined(redis: Redis, items: Sequence[Any], queue: Any) -> list[Any]:
    """Run `queue(pipe, item)` for every item in batched non-transactional pipelines; results in order."""
    out: list[Any] = []
    for chunk in _chunks(items):
        async with redis.pipeline(transaction=False) as pipe:
            for item in chunk:
                queue(pipe, item)
            out.extend(await pipe.execute())
    return out


@dataclass
class _TaskState:
    t: str
    record: dict[str, Any] | None = None
    captures: set[str] = field(default_factory=set)
    open: set[str] = field(default_factory=set)
    committed: set[str] = field(default_factory=set)
    metas: dict[str, Any] = field(default_factory=dict)  # capture id -> decoded metadata
    staged: set[str] = field(default_factory=set)
    turn_captures: dict[str, set[str]] = field(default_factory=dict)
    turn_publish: dict[str, str] = field(default_factory=dict)
    turn_publishers: set[str] = field(default_factory=set)  # turns whose claim names its holder
    reward: dict[str, Any] | None = None
    ttl: int = -1

    def sample_ids(self, c: str) -> list[str]:
        """The samples committed capture `c` makes: itself, and `<c>.1` … for each further choice of an `n` > 1
        answer (its metadata's `samples`, issue 35)."""
        meta = self.metas.get(c)
        count = meta.get("samples") if isinstance(meta, dict) else None
        return [c, *(f"{c}.{i}" for i in range(1, count if type(count) is int else 1))]

    def sample_count(self, captures: Iterable[str]) -> int:
        return sum(len(self.sample_ids(c)) for c in captures)

    def describe_committed(self) -> str:
        count = self.sample_count(self.committed)
        more = f" making {count} samples" if count != len(self.committed) else ""
        return f"{len(self.committed)} committed captures{more}"


async def check_invariants(
    redis: Redis,
    *,
    model_id: str,
    sent: ClientRecord | None = None,
    raise_on_violation: bool = True,
    strict_active_index: bool = False,
    statuses: Sequence[str] = ALL_SAMPLE_STATUSES,
    training_policy: TrainingPolicyConfig | dict[str, Any] | None = None,
) -> InvariantReport:
    """Check every invariant of one service database (owner `model_id`); see the module docstring.

    `strict_active_index`: also flag ids in `tasks:active` whose Task is no longer active (the contract allows
    their lazy removal; startup recovery drops them). Call it once the workload has settled: operations in flight
    (a reward being projected, a turn being published) show up as violations. `training_policy`: the service's
    `training_policy` (a dict as in its config, or the model): the due index and the run count are checked
    against it."""
    policy = TrainingPolicyConfig(**training_policy) if isinstance(training_policy, dict) else training_policy
    report = InvariantReport()
    all_keys = sorted({_s(k) or "" async for k in redis.scan_iter(match="*", count=1000)})
    report.keys = len(all_keys)

    tasks: dict[str, _TaskState] = {}
    sample_ids: list[str] = []
    run_ids: list[str] = []
    index_keys: dict[str, str] = {}  # status -> key
    # The lines that may own indexes and counters: the model id (default) and each registered lineage's line.
    lines = {model_id, *(line_of(model_id, _s(m) or "") for m in await redis.zrange(keys.LINEAGES, 0, -1))}

    def task_state(t: str) -> _TaskState:
        return tasks.setdefault(t, _TaskState(t))

    typed: dict[str, list[tuple[str, dict[str, str]]]] = defaultdict(list)
    for key in all_keys:
        if not key.startswith(PREFIX):
            report.add(f"key outside the service prefix {PREFIX!r}: {key!r}")
            continue
        shape = classify_key(key)
        if shape is None:
            report.add(f"key with no known shape (CONTRACT §5.2): {key!r}")
            continue
        name, groups = shape
        typed[name].append((key, groups))
        if "t" in groups:
            task_state(groups["t"])
        if name == "traj":
            sample_ids.append(groups["s"])
        elif name == "run":
            run_ids.append(groups["r"])
        elif name == "traj_index":
            if groups["o"] not in lines:
                report.add(f"status index of another owner: {key!r}")
            elif groups["status"] not in statuses:
                report.add(f"status index of an unknown status: {key!r}")
            elif groups["o"] == model_id:
                index_keys[groups["status"]] = key
        elif name == "traj_stats" and groups["o"] not in lines:
            report.add(f"counters of another owner: {key!r}")

    # Rail samples in flight are found again at startup only through the session list.
    inflight_sessions = {_s(m) or "" for m in await redis.smembers(keys.RAIL_INFLIGHT_SESSIONS)}
    for key, groups in typed.get("rail_inflight", []):
        if await redis.zcard(key) and groups["rs"] not in inflight_sessions:
            report.add(f"rail samples in flight for session {groups['rs']} but the session is not listed for recovery")
    # The owner of a session's pop leaves with the session's last in-flight entry.
    for session in sorted({_s(f) or "" for f in await redis.hkeys(keys.RAIL_INFLIGHT_OWNERS)} - inflight_sessions):
        report.add(f"rail session {session} has an in-flight owner but nothing in flight")

    owner = _s(await redis.get(keys.OWNER))
    if owner is not None and owner != model_id:
        report.add(f"rl:v1:owner is {owner!r}, not {model_id!r}")

    samples = await _check_samples(redis, report, model_id, sorted(lines), sample_ids, statuses)
    await _check_prompt_blocks(redis, report, sample_ids, [g["b"] for _, g in typed.get("prompt_block", [])])
    await _check_reward_deadlines(redis, report, model_id, sorted(lines), samples)
    await _check_waiting_hint(redis, report, model_id, sorted(lines), policy)
    await _check_lineage_lifecycle(redis, report, [g["lineage"] for _, g in typed.get("lineage_state", [])])
    await _check_excluded(redis, report, samples)
    await _check_task_listings(redis, report, typed)
    live_runs = await _check_runs(redis, report, run_ids, samples, model_id, policy)
    await _check_run_lines(redis, report, run_ids, samples)
    await _check_rollouts(redis, report, [g["ro"] for _, g in typed.get("rollout", [])],
                          [g["lineage"] for _, g in typed.get("lineage_rollout_current", [])])
    await _load_tasks(redis, tasks, typed)
    await _check_tasks(redis, report, tasks, strict_active_index)
    _check_task_samples(report, tasks, samples)
    if sent is not None:
        await _load_judges(redis, report, sent, samples)
        _check_client(report, sent, tasks, samples)
    await _check_ttls(redis, report, tasks, samples, live_runs)

    report.tasks = sum(1 for s in tasks.values() if s.record is not None)
    report.captures = sum(len(s.captures) for s in tasks.values())
    if raise_on_violation and not report.ok:
        raise InvariantViolation(report.describe())
    return report


# ------------------------------------------------------------------------------------------------------ samples


@dataclass
class _Sample:
    sample_id: str
    status: str | None
    source: str
    policy_version: str
    rl_task_id: str
    run_id: str
    instance: str = ""  # the vLLM instance that served it ("" when unknown)
    line: str = ""  # the line it belongs to (docs/lineages.md): the model id for the default lineage
    constraint_excluded: bool = False  # it carries an `exclusion` of the training policy (issue 35)
    judge: Any = None  # loaded only for the samples a ClientRecord vouches for (`_load_judges`)
    indexes: list[str] = field(default_factory=list)


async def _check_samples(
    redis: Redis, report: InvariantReport, model_id: str, lines: list[str], sample_ids: list[str],
    statuses: Sequence[str],
) -> dict[str, _Sample]:
    """Invariant 5, per line: one index per sample, its own line's, matching its status; each line's counters
    equal what is stored."""
    # Index fields only: the documents (`sample_json`) are large, and read only where a ClientRecord needs them.
    fields = ("status", "source", "policy_version", "rl_task_id", "run_id", "user_id", "instance", "lineage",
              "exclusion")
    rows = await _pipelined(redis, sample_ids, lambda p, s: p.hmget(keys.traj(s), fields))
    samples: dict[str, _Sample] = {}
    for sample_id, row in zip(sample_ids, rows):
        status, source, policy, task, run_id, user, instance, lineage, exclusion = (_s(v) for v in row)
        line = line_of(model_id, lineage or DEFAULT_LINEAGE)
        if lineage == DEFAULT_LINEAGE:
            report.add(f"sample {sample_id}: hash field lineage 'default' (the default lineage is never stored)")
        if line not in lines:
            report.add(f"sample {sample_id}: lineage {lineage!r} is not registered")
        if user is not None and user != model_id:
            report.add(f"sample {sample_id}: user_id {user!r} is not the service owner {model_id!r}")
        samples[sample_id] = _Sample(sample_id, status, source or "", policy or "base", task or "", run_id or "",
                                     instance or "", line=line, constraint_excluded=exclusion is not None)
        if status is None:
            report.add(f"sample {sample_id}: hash without a status field")
        elif status not in statuses:
            report.add(f"sample {sample_id}: unknown status {status!r}")
    report.samples = len(samples)

    members: dict[tuple[str, str], list[str]] = {}
    for line in lines:
        for status in statuses:
            found = [_s(m) or "" for m in await redis.zrange(keys.traj_index(line, status), 0, -1)]
            members[line, status] = found
            report.samples_by_status[status] = report.samples_by_status.get(status, 0) + len(found)
            for sample_id in found:
                sample = samples.get(sample_id)
                if sample is None:
                    report.add(f"index {line}:{status}: member {sample_id} has no sample hash")
                    continue
                if sample.line != line:  # no sample of one line is ever in another line's index
                    report.add(f"sample {sample_id} of line {sample.line!r} is in line {line!r}'s {status} index")
                sample.indexes.append(status)
    for sample in samples.values():
        if len(sample.indexes) > 1:
            report.add(f"sample {sample.sample_id} is in {len(sample.indexes)} status indexes: {sample.indexes}")
        elif not sample.indexes:
            report.add(f"sample {sample.sample_id} (status {sample.status}) is in no status index")
        elif sample.status is not None and sample.indexes[0] != sample.status:
            report.add(f"sample {sample.sample_id}: hash status {sample.status!r} but in index {sample.indexes[0]!r}")

    for line in lines:
        raw = await redis.hgetall(keys.traj_stats(line))
        counters = {_s(k) or "": int(v) for k, v in raw.items()}
        expected: Counter[str] = Counter()
        for status in statuses:
            expected[f"status:{status}"] = len(members[line, status])
        for sample in samples.values():
            if sample.line != line:
                continue
            expected[f"source:{sample.source}"] += 1
            if sample.status == "pending":
                expected[f"pending_policy:{sample.policy_version}"] += 1
        # `expired_unrewarded` and the reward policy's `reward_*` tallies count events, not stored samples.
        derived = {n for n in counters if n != "expired_unrewarded" and not n.startswith("reward_")}
        where = "" if line == model_id else f" of line {line}"
        for name in sorted(set(expected) | derived):
            have, want = counters.get(name, 0), expected.get(name, 0)
            if have != want:
                report.add(f"counter {name}{where} = {have}, but the store holds {want}")
        if counters.get("expired_unrewarded", 0) < 0:
            report.add(f"counter expired_unrewarded{where} is negative: {counters['expired_unrewarded']}")
    return samples


async def _check_run_lines(
    redis: Redis, report: InvariantReport, run_ids: list[str], samples: dict[str, _Sample]
) -> None:
    """No run's batch holds a sample of another lineage's line (a run claims from its own line's index)."""
    raws = await _pipelined(redis, run_ids, lambda p, r: p.get(keys.training_run(r)))
    for run_id, raw in zip(run_ids, raws):
        record = _json(raw)
        if not isinstance(record, dict):
            continue  # `_check_runs` reports it
        lineage = record.get("lineage", DEFAULT_LINEAGE)
        if lineage == DEFAULT_LINEAGE and "lineage" in record:
            report.add(f"run {run_id}: record field lineage 'default' (the default lineage is never stored)")
        for sample_id in record.get("sample_ids") or []:
            sample = samples.get(sample_id)
            if sample is not None and sample.line.partition(":")[2] != ("" if lineage == DEFAULT_LINEAGE else lineage):
                report.add(f"run {run_id} of lineage {lineage!r} holds sample {sample_id} of line {sample.line!r}")


async def _check_excluded(redis: Redis, report: InvariantReport, samples: dict[str, _Sample]) -> None:
    """Invariant 11: what an excluded instance served is never trainable, and only that, or a sample whose constraint
    the training policy excludes (its `exclusion`), is `excluded`."""
    excluded = {_s(m) or "" for m in await redis.smembers(keys.EXCLUDED_INSTANCES)}
    for sample in samples.values():
        if sample.instance in excluded and sample.status in (SampleStatus.PENDING, SampleStatus.AWAITING_REWARDS):
            report.add(f"sample {sample.sample_id} of excluded instance {sample.instance!r} is {sample.status}")
        if sample.status == SampleStatus.EXCLUDED and sample.instance not in excluded and not sample.constraint_excluded:
            report.add(f"sample {sample.sample_id} is excluded, but its instance {sample.instance!r} is not")
        if sample.constraint_excluded and sample.status not in (SampleStatus.EXCLUDED, None):
            report.add(f"sample {sample.sample_id} carries a constraint exclusion but is {sample.status}")


async def _check_prompt_blocks(
    redis: Redis, report: InvariantReport, sample_ids: list[str], block_hexes: list[str]
) -> None:
    """Invariant P: blocks and references agree exactly, contents match their chained digests, no TTL."""
    fields = await _pipelined(redis, sample_ids, lambda p, s: p.hget(keys.traj(s), "prompt_blocks"))
    referenced: dict[str, list[bytes]] = {}
    expected: Counter[bytes] = Counter()
    for sample_id, field in zip(sample_ids, fields):
        try:
            digests = prompt_blocks.unpack_digests(field)
        except ValueError:
            report.add(f"sample {sample_id}: prompt_blocks is not a list of 16-byte digests")
            continue
        if len(set(digests)) != len(digests):
            report.add(f"sample {sample_id}: references a prompt block twice")
        referenced[sample_id] = digests
        expected.update(digests)
    stored = sorted(bytes.fromhex(h) for h in block_hexes)
    rows = await _pipelined(redis, stored, lambda p, d: (
        p.hmget(prompt_blocks.block_key(d), ("ids", "refs")), p.ttl(prompt_blocks.block_key(d))))
    contents: dict[bytes, bytes] = {}
    for i, digest in enumerate(stored):
        (ids, refs), ttl = rows[2 * i], rows[2 * i + 1]
        name = digest.hex()
        if ids is None or len(ids) != prompt_blocks.BLOCK_BYTES:
            report.add(f"prompt block {name}: ids missing or not one block ({len(ids or b'')} bytes)")
        else:
            contents[digest] = ids
        have, want = int(refs or 0), expected.get(digest, 0)
        if want == 0:
            report.add(f"prompt block {name} is referenced by no sample (refs {have})")
        elif have != want:
            report.add(f"prompt block {name}: refs {have}, but {want} sample(s) reference it")
        if ttl != -1:
            report.add(f"prompt block {name} has a TTL ({ttl} s)")
    for sample_id, digests in sorted(referenced.items()):
        missing = [d.hex() for d in digests if d not in contents]
        if missing:
            report.add(f"sample {sample_id} references missing prompt block(s) {missing[:3]}")
        elif not prompt_blocks.verify_chain(digests, [contents[d] for d in digests]):
            report.add(f"sample {sample_id}: its prompt blocks do not match their chained digests")


async def _check_reward_deadlines(
    redis: Redis, report: InvariantReport, model_id: str, lines: list[str], samples: dict[str, _Sample]
) -> None:
    """Reward policy, per line: a line's deadline index holds exactly its `awaiting_rewards` samples, each with its
    per-source state; every other line with deadlines has a due-hint at or below its earliest one (and only those
    have one), so the sweeper finds every waiting sample and nothing else."""
    hints = {(_s(m) or ""): score for m, score in await redis.zrange(keys.REWARD_DUE_LINES, 0, -1, withscores=True)}
    for line in lines:
        waiting = {s.sample_id for s in samples.values()
                   if s.status == SampleStatus.AWAITING_REWARDS and s.line == line}
        entries = await redis.zrange(keys.reward_deadlines(line), 0, -1, withscores=True)
        indexed = {_s(m) or "" for m, _ in entries}
        where = "" if line == model_id else f" of line {line}"
        for sample_id in sorted(waiting - indexed):
            report.add(f"sample {sample_id} awaits rewards but has no deadline entry{where}")
        for sample_id in sorted(indexed - waiting):
            report.add(f"deadline entry {sample_id}{where} is not an awaiting_rewards sample of that line")
        if line != model_id and entries and not (line in hints and hints[line] <= min(s for _, s in entries)):
            report.add(f"line {line} has reward deadlines but no due-hint at or below its earliest one")
    for line in sorted(set(hints) - set(lines) | ({model_id} & set(hints))):
        report.add(f"due-hint for {line!r}, which is not a registered lineage's line")
    ids = sorted({s.sample_id for s in samples.values() if s.status == SampleStatus.AWAITING_REWARDS})
    for sample_id, has in zip(ids, await _pipelined(redis, ids, lambda p, s: p.hexists(keys.traj(s), "rewards"))):
        if not has:
            report.add(f"sample {sample_id} awaits rewards but has no per-source reward state")


async def _check_waiting_hint(redis: Redis, report: InvariantReport, model_id: str, lines: list[str],
                              policy: TrainingPolicyConfig | None) -> None:
    """Automatic training over lineages (keys.TRAINING_WAITING, the due index): an entry names only a registered
    lineage's line (never the default line, which is always judged). With the service's policy: a line with pending
    samples may lack an entry only when nothing but a write could make it eligible (automatic training off for it,
    paused, below its threshold and its floor-with-a-wait), so the scheduler, which reads only due entries, reaches
    every line that may become eligible. An entry of a line with nothing pending is allowed: the scheduler removes
    it when it judges it. The pending count stands for the eligible one (it bounds it from above)."""
    hints = {(_s(m) or ""): score for m, score in await redis.zrange(keys.TRAINING_WAITING, 0, -1, withscores=True)}
    others = [line for line in lines if line != model_id]
    for line in sorted(set(hints) - set(others)):
        report.add(f"training due-index entry for {line!r}, which is not a registered lineage's line")
    lineages = {split_line(line)[1] for line in lines}
    for name in sorted({_s(f) or "" for f in await redis.hkeys(keys.FAIR_SHARE)} - lineages - {keys.FAIR_SHARE_CLOCK}):
        report.add(f"fair-share tag for {name!r}, which is not a registered lineage")
    for line in sorted({_s(f) or "" for f in await redis.hkeys(keys.ELIGIBLE_SINCE)} - set(lines)):
        report.add(f"eligible_since for {line!r}, which is not a registered lineage's line")
    if policy is None:
        return
    paused = {_s(f) or "" for f in await redis.hkeys(keys.LINEAGES_PAUSED)}
    counts = await _pipelined(redis, others, lambda p, line: p.zcard(keys.traj_index(line, SampleStatus.PENDING)))
    # An archived lineage, or one being deleted, is judged as paused (lineage_state.py).
    retired = await _pipelined(redis, others, lambda p, line: p.exists(keys.lineage_state(split_line(line)[1])))
    for line, pending, state in zip(others, counts, retired):
        lineage = split_line(line)[1]
        rule = policy.for_lineage(lineage)
        could = rule.auto and lineage not in paused and not state and pending > 0 and (
            pending >= rule.min_pending_samples
            or (rule.max_wait_seconds is not None and pending >= rule.min_batch_on_wait))
        if could and line not in hints:
            report.add(f"line {line} has {pending} pending sample(s) and could become eligible, but is not due")


async def _check_lineage_lifecycle(redis: Redis, report: InvariantReport, with_state: list[str]) -> None:
    """Lineage lifecycle (docs/lineages.md "Lifecycle"): a state only for a registered lineage, and never `live`
    (live is its absence); the marker lists only archived or deleting lineages, every deleting one included; the
    idle clock only live registered lineages; the agent-key cap's counts equal the lineages each key registered,
    and those are registered."""
    registered = {_s(m) or "" for m in await redis.zrange(keys.LINEAGES, 0, -1)}
    states: dict[str, str] = {}
    for lineage in with_state:
        record = _json(await redis.get(keys.lineage_state(lineage)))
        state = record.get("state") if isinstance(record, dict) else None
        states[lineage] = str(state)
        if lineage not in registered:
            report.add(f"lineage {lineage!r} has a lifecycle state but is not registered")
        if state not in ("archived", "deleting"):
            report.add(f"lineage {lineage!r}: lifecycle state {state!r} is neither archived nor deleting")
    retiring = {_s(m) or "" for m in await redis.zrange(keys.LINEAGES_RETIRING, 0, -1)}
    for lineage in sorted(retiring - set(states)):
        report.add(f"lineage {lineage!r} is marked retiring but is neither archived nor being deleted")
    for lineage in sorted(name for name, state in states.items() if state == "deleting" and name not in retiring):
        report.add(f"lineage {lineage!r} is being deleted but no leader would finish it (not in lineages:retiring)")
    for lineage in sorted({_s(m) or "" for m in await redis.zrange(keys.LINEAGES_LAST_TASK, 0, -1)}):
        if lineage not in registered or lineage in states:
            report.add(f"idle clock for {lineage!r}, which is not a live registered lineage")
    registrars = {(_s(k) or ""): (_s(v) or "") for k, v in (await redis.hgetall(keys.LINEAGES_REGISTERED_BY)).items()}
    for lineage in sorted(set(registrars) - registered):
        report.add(f"lineage {lineage!r} has a registering agent key but is not registered")
    counts = {(_s(k) or ""): int(v) for k, v in (await redis.hgetall(keys.LINEAGES_COUNT_BY_KEY)).items()}
    per_key = Counter(registrars.values())
    for key_id in sorted(set(counts) | set(per_key)):
        if counts.get(key_id, 0) != per_key.get(key_id, 0):
            report.add(f"agent key {key_id!r} counts {counts.get(key_id, 0)} registered lineage(s) but registered "
                       f"{per_key.get(key_id, 0)}")


async def _check_task_listings(
    redis: Redis, report: InvariantReport, typed: dict[str, list[tuple[str, dict[str, str]]]]
) -> None:
    """Listings: a Task is listed under at most one status, the one its record holds (a listed id whose record
    expired is allowed: pages skip it and the sweeper trims it)."""
    seen: dict[str, str] = {}
    for key, groups in typed.get("tasks_by_status", []):
        members = [_s(m) or "" for m in await redis.zrange(key, 0, -1)]
        records = await _pipelined(redis, members, lambda p, t: p.get(keys.task(t)))
        for t, raw in zip(members, records):
            if t in seen:
                report.add(f"task {t} is listed under both {seen[t]} and {groups['ts']}")
            seen[t] = groups["ts"]
            record = _json(raw)
            if isinstance(record, dict) and record.get("status") != groups["ts"]:
                report.add(f"task {t} is listed under {groups['ts']} but is {record.get('status')}")
    # Listings per lineage (docs/lineages.md): an id in a lineage's index is a record of that lineage (and of that
    # status); once the one-time backfill is done, every listed Task with a record is in its lineage's indexes.
    by_lineage: dict[str, set[str]] = {}
    for family in ("tasks_by_lineage", "tasks_by_lineage_status"):
        for key, groups in typed.get(family, []):
            members = [_s(m) or "" for m in await redis.zrange(key, 0, -1)]
            records = await _pipelined(redis, members, lambda p, t: p.get(keys.task(t)))
            for t, raw in zip(members, records):
                by_lineage.setdefault(key, set()).add(t)
                record = _json(raw)
                if not isinstance(record, dict):
                    continue
                if record.get("lineage", "default") != groups["lineage"]:
                    report.add(f"task {t} is in lineage {groups['lineage']!r}'s listing but is of "
                               f"{record.get('lineage', 'default')!r}")
                if "ts" in groups and record.get("status") != groups["ts"]:
                    report.add(f"task {t} is in lineage {groups['lineage']!r}'s {groups['ts']} listing but is "
                               f"{record.get('status')}")
    if _s(await redis.get(keys.LISTINGS_LINEAGE_BACKFILL)) == "done":
        for key, _groups in typed.get("tasks_by_created", []):
            members = [_s(m) or "" for m in await redis.zrange(key, 0, -1)]
            records = await _pipelined(redis, members, lambda p, t: p.get(keys.task(t)))
            for t, raw in zip(members, records):
                record = _json(raw)
                if not isinstance(record, dict):
                    continue
                lineage, status = record.get("lineage", "default"), record.get("status")
                for index in (keys.tasks_by_lineage(lineage), keys.tasks_by_lineage_status(lineage, status)):
                    if t not in by_lineage.get(index, set()):
                        report.add(f"task {t} is listed but missing from {index}")


# --------------------------------------------------------------------------------------------------------- runs


async def _check_runs(
    redis: Redis, report: InvariantReport, run_ids: list[str], samples: dict[str, _Sample], model_id: str,
    policy: TrainingPolicyConfig | None,
) -> list[dict[str, Any]]:
    """Invariant 6 per line: each live run is named by its lineage's pointer and each pointer names a live run of
    its lineage; at most `max_concurrent_runs` live; claimed samples belong to the live run of their line."""
    raws = await _pipelined(redis, run_ids, lambda p, r: p.get(keys.training_run(r)))
    runs: dict[str, dict[str, Any]] = {}
    for run_id, raw in zip(run_ids, raws):
        record = _json(raw)
        if not isinstance(record, dict):
            report.add(f"run {run_id}: record is not a JSON object")
            continue
        runs[run_id] = record
    report.runs = len(runs)
    # lineage → the run id its pointer names
    pointers = {(_s(k) or ""): (_s(v) or "") for k, v in (await redis.hgetall(keys.ACTIVE_LINEAGE_RUNS)).items()}
    if DEFAULT_LINEAGE in pointers:
        report.add("training_runs:active_lineages has a field for the default lineage (its pointer is "
                   "training_run:active)")
    default_pointer = _s(await redis.get(keys.ACTIVE_RUN))
    if default_pointer is not None:
        pointers[DEFAULT_LINEAGE] = default_pointer
    live = {r: rec for r, rec in runs.items() if rec.get("status") not in TERMINAL_RUN_STATUSES}
    for run_id, record in sorted(live.items()):
        lineage = record.get("lineage", DEFAULT_LINEAGE)
        if pointers.get(lineage) != run_id:
            report.add(f"run {run_id} of lineage {lineage!r} is {record.get('status')} but its lineage's pointer "
                       f"names {pointers.get(lineage)}")
    for lineage, run_id in sorted(pointers.items()):
        record = runs.get(run_id)
        if record is None:
            report.add(f"the active run pointer of lineage {lineage!r} names {run_id}, which has no record")
        elif record.get("status") in TERMINAL_RUN_STATUSES:
            report.add(f"the active run pointer of lineage {lineage!r} names {run_id}, which is {record.get('status')}")
        elif record.get("lineage", DEFAULT_LINEAGE) != lineage:
            report.add(f"the active run pointer of lineage {lineage!r} names {run_id} of lineage "
                       f"{record.get('lineage', DEFAULT_LINEAGE)!r}")
    if policy is not None and len(live) > policy.max_concurrent_runs:
        report.add(f"{len(live)} runs live, more than max_concurrent_runs {policy.max_concurrent_runs}: {sorted(live)}")
    batches = {r: set(rec.get("sample_ids") or []) for r, rec in live.items()}
    for sample in samples.values():
        if sample.status == SampleStatus.OUTDATED and sample.run_id:
            report.add(f"sample {sample.sample_id} is outdated but was claimed by run {sample.run_id!r}")
        if sample.status not in CLAIMED_STATUSES:
            continue
        record = live.get(sample.run_id)
        if record is None:
            report.add(f"sample {sample.sample_id} is {sample.status} for run {sample.run_id!r}, which is not live")
        elif sample.sample_id not in batches[sample.run_id]:
            report.add(f"sample {sample.sample_id} is {sample.status} for run {sample.run_id}, not in its batch")
        elif line_of(model_id, record.get("lineage", DEFAULT_LINEAGE)) != sample.line:
            report.add(f"sample {sample.sample_id} of line {sample.line!r} is claimed by run {sample.run_id} of "
                       f"lineage {record.get('lineage', DEFAULT_LINEAGE)!r}")
    for run_id, record in runs.items():
        ids = record.get("sample_ids") or []
        if len(ids) != len(set(ids)):
            report.add(f"run {run_id}: a sample id appears twice in its batch")
        if record.get("sample_count") != len(ids):
            report.add(f"run {run_id}: sample_count {record.get('sample_count')} != batch size {len(ids)}")
    return list(live.values())


ROLLOUT_LIVE_STATUSES = frozenset({"running", "paused", "promoting", "rolling_back", "activating"})


async def _check_rollouts(redis: Redis, report: InvariantReport, rollout_ids: list[str],
                          pointer_lineages: list[str]) -> None:
    """Invariant 10 (docs/rollout.md), per line (docs/lineages.md): each line's current pointer names exactly the
    one non-terminal rollout of that line (`rollout:current` for the default line, the lineage's own pointer else);
    `rollouts:live_lineages` holds exactly the lineages with a pointer; every record is listed; a canary has a
    candidate distinct from its baseline, and its versions are its own line's."""
    raws = await _pipelined(redis, rollout_ids, lambda p, r: p.get(keys.rollout(r)))
    live: dict[str, list[str]] = defaultdict(list)
    listed = {_s(m) for m in await redis.zrange(keys.ROLLOUTS_BY_CREATION, 0, -1)}
    for rollout_id, raw in zip(rollout_ids, raws):
        record = _json(raw)
        if not isinstance(record, dict) or record.get("rollout_id") != rollout_id:
            report.add(f"rollout {rollout_id}: record is not a JSON object naming itself")
            continue
        lineage = record.get("lineage") or DEFAULT_LINEAGE
        if record.get("lineage") == DEFAULT_LINEAGE:
            report.add(f"rollout {rollout_id}: a default-line record carries lineage")
        if record.get("status") in ROLLOUT_LIVE_STATUSES:
            live[lineage].append(rollout_id)
        if rollout_id not in listed:
            report.add(f"rollout {rollout_id} is not in the rollout listing")
        candidate = (record.get("candidate") or {}).get("lora_name")
        if record.get("kind") == "canary" and candidate == (record.get("baseline") or {}).get("lora_name"):
            report.add(f"rollout {rollout_id}: the candidate is its own baseline")
        for side in ("candidate", "baseline"):
            name = (record.get(side) or {}).get("lora_name")
            parsed = parse_version_name(name)
            if name is not None and name != "base" and (parsed is None or split_line(parsed[0])[1] != lineage):
                report.add(f"rollout {rollout_id} of lineage {lineage!r}: its {side} {name!r} is no version of "
                           "its line")
    flagged = {_s(m) for m in await redis.smembers(keys.ROLLOUT_LIVE_LINEAGES)}
    if flagged != set(pointer_lineages):
        report.add(f"rollouts:live_lineages is {sorted(flagged)}, the lineages with a rollout pointer are "
                   f"{sorted(pointer_lineages)}")
    for lineage in sorted({DEFAULT_LINEAGE, *pointer_lineages, *live}):
        pointer = _s(await redis.get(keys.rollout_current(lineage)))
        ids = sorted(live.get(lineage, []))
        if len(ids) > 1:
            report.add(f"more than one rollout not ended on lineage {lineage!r}: {ids}")
        if pointer is None and ids:
            report.add(f"rollouts {ids} of lineage {lineage!r} are not ended but none is current")
        if pointer is not None and ids != [pointer]:
            report.add(f"lineage {lineage!r}'s current rollout pointer names {pointer}, the rollouts not ended "
                       f"are {ids}")


# -------------------------------------------------------------------------------------------------------- tasks


async def _load_tasks(redis: Redis, tasks: dict[str, _TaskState], typed: dict[str, list]) -> None:
    ids = sorted(tasks)
    rows = await _pipelined(redis, ids, lambda p, t: (
        p.get(keys.task(t)), p.smembers(keys.captures(t)), p.smembers(keys.open_captures(t)),
        p.smembers(keys.committed_captures(t)), p.get(keys.reward(t)), p.ttl(keys.task(t)),
    ))
    for i, t in enumerate(ids):
        record, captures, open_, committed, reward, ttl = rows[6 * i:6 * i + 6]
        state = tasks[t]
        decoded = _json(record)
        state.record = decoded if isinstance(decoded, dict) else ({"_undecodable": True} if record else None)
        state.captures = {_s(c) or "" for c in captures}
        state.open = {_s(c) or "" for c in open_}
        state.committed = {_s(c) or "" for c in committed}
        reward_state = _json(reward)
        state.reward = reward_state if isinstance(reward_state, dict) else None
        state.ttl = ttl
    metas = [(g["t"], g["c"], k) for k, g in typed.get("capture", [])]
    for (t, c, _), raw in zip(metas, await _pipelined(redis, metas, lambda p, m: p.get(m[2]))):
        tasks[t].metas[c] = _json(raw)
    for _, g in typed.get("staged", []):
        tasks[g["t"]].staged.add(g["c"])
    turn_sets = [(g["t"], g["u"], k) for k, g in typed.get("turn_captures", [])]
    for (t, u, _), members in zip(turn_sets, await _pipelined(redis, turn_sets, lambda p, m: p.smembers(m[2]))):
        tasks[t].turn_captures[u] = {_s(c) or "" for c in members}
    publish = [(g["t"], g["u"], k) for k, g in typed.get("turn_publish", [])]
    for (t, u, _), raw in zip(publish, await _pipelined(redis, publish, lambda p, m: p.get(m[2]))):
        tasks[t].turn_publish[u] = _s(raw) or ""
    for _, g in typed.get("turn_publisher", []):
        tasks[g["t"]].turn_publishers.add(g["u"])


async def _check_tasks(
    redis: Redis, report: InvariantReport, tasks: dict[str, _TaskState], strict_active_index: bool
) -> None:
    """Invariants 1, 2, 3."""
    active_index = {_s(t) or "" for t in await redis.smembers(keys.ACTIVE_TASKS)}
    awaiting = {_s(t) or "" for t in await redis.zrange(keys.TASKS_AWAITING_REWARD, 0, -1)}
    gc = {_s(t) or "" for t in await redis.zrange(keys.TASKS_GC, 0, -1)}
    for t in sorted(awaiting & gc):
        report.add(f"task {t} is in both the awaiting-reward and the gc index")
    sessions = sorted({str(s.record.get("agent_session_id")) for s in tasks.values()
                       if s.record and s.record.get("status") == "active"})
    pointers = dict(zip(sessions, [_s(v) for v in await _pipelined(
        redis, sessions, lambda p, s: p.get(keys.active_session(s)))]))
    for t, state in sorted(tasks.items()):
        rec = state.record
        if rec is None:
            if state.captures or state.open or state.committed or state.staged:
                report.add(f"task {t}: capture keys without a Task record")
            if t in active_index and strict_active_index:
                report.add(f"task {t}: in the active index without a record")
            continue
        if rec.get("_undecodable"):
            report.add(f"task {t}: record is not a JSON object")
            continue
        status = rec.get("status")
        if status == "active":
            if t not in active_index:
                report.add(f"task {t} is active but not in the active index")
            session = str(rec.get("agent_session_id"))
            if pointers.get(session) != t:
                report.add(f"task {t} is active but session {session} points to {pointers.get(session)}")
        elif status in ("finalized", "aborted"):
            if t in active_index and strict_active_index:
                report.add(f"task {t} is {status} but still in the active index")
            if state.open:
                report.add(f"task {t} is {status} with open captures {sorted(state.open)}")
            open_metas = sorted(c for c, m in state.metas.items() if isinstance(m, dict) and m.get("status") == "open")
            if open_metas:
                report.add(f"task {t} is {status} with open capture metadata {open_metas}")
        else:
            report.add(f"task {t}: unknown status {status!r}")
        if t in awaiting and (status != "finalized" or rec.get("reward_mode") != "terminal"):
            report.add(f"task {t} awaits a reward but is {status} ({rec.get('reward_mode')})")
        if status == "finalized" and state.staged and state.reward is None and t not in awaiting:
            # The sweeper finds unrewarded staged samples only through this index: they would never expire.
            report.add(f"task {t} stages samples for a reward but is not in the awaiting-reward index")
        # Invariant 2: one of open/committed; captures = open ∪ committed; metadata agrees.
        both = state.open & state.committed
        if both:
            report.add(f"task {t}: captures both open and committed: {sorted(both)}")
        if state.captures != state.open | state.committed:
            report.add(f"task {t}: captures {sorted(state.captures)} != open {sorted(state.open)} ∪ "
                       f"committed {sorted(state.committed)}")
        for c in sorted(state.captures):
            meta = state.metas.get(c)
            want = "committed" if c in state.committed else "open"
            if not isinstance(meta, dict):
                report.add(f"task {t}: capture {c} is {want} but has no metadata")
            elif meta.get("status") != want:
                report.add(f"task {t}: capture {c} metadata says {meta.get('status')!r}, sets say {want!r}")
        for c in sorted(set(state.metas) - state.captures):
            report.add(f"task {t}: capture metadata {c} belongs to no capture set")
        for u, members in sorted(state.turn_captures.items()):
            if members - state.committed:
                report.add(f"task {t}: turn {u} lists uncommitted captures {sorted(members - state.committed)}")
        # Invariant 3: staged only for a committed capture still waiting for its publication.
        for c in sorted(state.staged):
            if c not in state.committed:
                report.add(f"task {t}: staged sample {c} without a committed capture")
            elif status == "aborted":
                report.add(f"task {t} is aborted but still stages sample {c}")
            elif state.reward and state.reward.get("status") in ("published", "expired"):
                report.add(f"task {t}: reward {state.reward.get('status')} but sample {c} is still staged")
            elif rec.get("reward_mode") == "delayed_feedback" and any(
                c in members and state.turn_publish.get(u) == "published"
                for u, members in state.turn_captures.items()
            ):
                report.add(f"task {t}: capture {c} of a published turn is still staged")


def _check_task_samples(report: InvariantReport, tasks: dict[str, _TaskState], samples: dict[str, _Sample]) -> None:
    """Invariant 4 in both directions: what must be a sample is exactly one, and no Task sample is unexplained."""
    by_task: dict[str, set[str]] = defaultdict(set)
    for sample in samples.values():
        if sample.rl_task_id:
            by_task[sample.rl_task_id].add(sample.sample_id)
    for t, state in sorted(tasks.items()):
        rec = state.record
        if not rec or rec.get("_undecodable"):
            continue
        must: set[str] = set()
        reward = state.reward or {}
        if reward.get("status") == "published":
            must |= state.committed
            if reward.get("sample_count") != state.sample_count(state.committed):
                report.add(f"task {t}: reward published with sample_count {reward.get('sample_count')} but "
                           f"{state.describe_committed()}")
        elif reward.get("status") == "projecting":
            report.add(f"task {t}: reward projection left `projecting` (interrupted and never repaired)")
        for u, published in state.turn_publish.items():
            if published == "published":
                must |= state.turn_captures.get(u, set())
            elif published == "publishing" and rec.get("status") != "active":
                report.add(f"task {t} is {rec.get('status')} with turn {u} left `publishing`")
        for u in sorted(state.turn_publishers):
            if state.turn_publish.get(u) != "publishing":
                report.add(f"task {t}: turn {u} names a publication holder but is {state.turn_publish.get(u)!r}")
        must = {sample_id for c in must for sample_id in state.sample_ids(c)}
        for c in sorted(must):
            sample = samples.get(c)
            if sample is None:
                report.add(f"task {t}: committed capture {c} of a published turn / rewarded Task has no sample")
            elif sample.rl_task_id != t:
                report.add(f"task {t}: capture {c} is a sample of task {sample.rl_task_id!r}")
        for c in sorted(by_task.get(t, set()) - must):
            report.add(f"task {t}: sample {c} comes from no published turn or rewarded capture")
        evaluation = rec.get("evaluation") is True
        for c in sorted(by_task.get(t, set())):
            status = samples[c].status
            if evaluation and status != SampleStatus.EVALUATION:
                report.add(f"task {t} is an evaluation Task but its sample {c} is {status}: it could be trained on")
            elif not evaluation and status == SampleStatus.EVALUATION:
                report.add(f"task {t} is not an evaluation Task but its sample {c} is {status}")
    for sample in samples.values():
        if sample.status == SampleStatus.EVALUATION and sample.run_id:
            report.add(f"evaluation sample {sample.sample_id} was claimed by run {sample.run_id}")
    for t in sorted(set(by_task) - {t for t, s in tasks.items() if s.record}):
        report.add(f"samples {sorted(by_task[t])[:5]} name task {t}, which has no record")


async def _load_judges(
    redis: Redis, report: InvariantReport, sent: ClientRecord, samples: dict[str, _Sample]
) -> None:
    """The `judge` of every stored sample the client record vouches for (rewarded Tasks, published turns)."""
    wanted = sorted(
        c for t, captures in sent.committed.items() for c, turn in captures.items()
        if c in samples and (t in sent.rewards or turn in sent.published_turns.get(t, set()))
    )
    raws = await _pipelined(redis, wanted, lambda p, c: p.hget(keys.traj(c), "sample_json"))
    for c, raw in zip(wanted, raws):
        try:
            meta = decode_meta(raw)
        except (orjson.JSONDecodeError, zlib.error):
            meta = None
        if not isinstance(meta, dict):
            report.add(f"sample {c}: sample_json is not a JSON object")
            continue
        samples[c].judge = meta.get("judge")


def _check_client(
    report: InvariantReport, sent: ClientRecord, tasks: dict[str, _TaskState], samples: dict[str, _Sample]
) -> None:
    """What the client was told: acknowledged rewards and published turns became exactly the samples it expects."""
    for t in sorted(sent.tasks):
        state = tasks.get(t)
        if state is None or state.record is None:
            report.add(f"client: task {t} was started (201) but has no record")
    for t in sorted(sent.finalized):
        state = tasks.get(t)
        if state and state.record and state.record.get("status") != "finalized":
            report.add(f"client: task {t} was stopped (200 finalized) but is {state.record.get('status')}")
    for t, (value, count) in sorted(sent.rewards.items()):
        state = tasks.get(t)
        committed = sent.committed.get(t, {})
        if state is None or state.record is None:
            report.add(f"client: rewarded task {t} has no record")
            continue
        if count != state.sample_count(state.committed):
            report.add(f"client: reward of {t} acknowledged {count} samples, the Task has {state.describe_committed()}")
        missing = sorted(set(committed) - state.committed)
        if missing:
            report.add(f"client: captures {missing[:5]} of rewarded task {t} were acknowledged but are not committed")
        for c in committed:
            report.client_samples_checked += 1
            sample = samples.get(c)
            if sample is None:
                report.add(f"client: capture {c} of rewarded task {t} has no sample (lost)")
            elif not isinstance(sample.judge, dict) or sample.judge.get("source") != "terminal" or not math.isclose(
                float(sample.judge.get("score", math.nan)), value
            ):
                report.add(f"client: sample {c} of task {t} carries judge {sample.judge!r}, not reward {value}")
    for t, turns in sorted(sent.published_turns.items()):
        for c, turn in sorted(sent.committed.get(t, {}).items()):
            if turn not in turns:
                continue
            report.client_samples_checked += 1
            sample = samples.get(c)
            if sample is None:
                report.add(f"client: capture {c} of published turn {turn} of task {t} has no sample (lost)")
            elif not isinstance(sample.judge, dict) or sample.judge.get("source") != "judge":
                report.add(f"client: sample {c} of task {t} turn {turn} has no Judge score: {sample.judge!r}")


async def _check_ttls(
    redis: Redis,
    report: InvariantReport,
    tasks: dict[str, _TaskState],
    samples: dict[str, _Sample],
    live_runs: list[dict[str, Any]],
) -> None:
    """Invariant 8: nothing that is still needed can expire."""
    for t, state in sorted(tasks.items()):
        if state.record and state.record.get("status") == "active" and state.ttl != -1:
            report.add(f"task {t} is active but its record has a TTL ({state.ttl} s)")
    keep = sorted(s.sample_id for s in samples.values() if s.status in NO_TTL_STATUSES)
    for sample_id, ttl in zip(keep, await _pipelined(redis, keep, lambda p, s: p.ttl(keys.traj(s)))):
        if ttl != -1:
            report.add(f"sample {sample_id} is {samples[sample_id].status} but has a TTL ({ttl} s)")
    awaiting = sorted((t, c) for t, s in tasks.items() if s.record and s.record.get("status") == "finalized"
                      for c in s.staged)
    for (t, c), ttl in zip(awaiting, await _pipelined(redis, awaiting, lambda p, tc: p.ttl(keys.staged(*tc)))):
        if ttl != -1:
            report.add(f"task {t}: staged sample {c} awaiting its reward has a TTL ({ttl} s)")
    for run in live_runs:
        ttl = await redis.ttl(keys.training_run(run["training_run_id"]))
        if ttl != -1:
            report.add(f"the live run {run['training_run_id']} has a TTL ({ttl} s)")
