"""Every Redis key of the service, built in one place (CONTRACT §5.2).

Each builder validates the components it puts in a key, so a hostile id can never reach Redis.
"""

from __future__ import annotations

from ...common.ids import InvalidIdentifier, require_rollout_id, require_run_id, require_task_id, require_token_id
from ...common.lineage import DEFAULT_LINEAGE, is_lineage
from ...common.wire.task_states import TASK_STATUSES
from .sample_status import ALL_SAMPLE_STATUSES

PREFIX = "rl:v1:"

OWNER = PREFIX + "owner"
ACTIVE_TASKS = PREFIX + "tasks:active"
# Finalized terminal-mode Tasks waiting for their reward (ZSET scored by finalization epoch); not to be confused
# with the sample status `SampleStatus.AWAITING_REWARDS`.
TASKS_AWAITING_REWARD = PREFIX + "tasks:awaiting_reward"
TASKS_GC = PREFIX + "tasks:gc"
TRAJ_USERS = PREFIX + "traj_users"
POLICY_OBSERVED = PREFIX + "policy:observed"
# HASH line → JSON {"lora_name", "lora_path", "at"}: the last active policy of each non-default line read from the
# gateway or made active by this service (the default line's stays in `policy:observed`, an AIGW key). The
# scheduler estimates a line's stale samples from it; every write is fenced, and precedes the line's repository
# marker so that a deposed leader stops before the file write (docs/lineages.md).
POLICY_OBSERVED_LINES = PREFIX + "policy:observed_lines"
RAIL_INFLIGHT_SESSIONS = PREFIX + "rail:inflight_sessions"  # sessions with popped rail samples not yet stored
# Active Training Runs (training/run_transitions.py, invariant 6 per line): the default lineage's run in
# `training_run:active` (STRING, the AIGW key, unchanged), every other lineage's in `training_runs:active_lineages`
# (HASH lineage → run id).
# A pointer is set in the claim's EXEC and deleted in the run's terminal EXEC; together they name every live run, at
# most `training_policy.max_concurrent_runs`, one per lineage. A `training_run:active` written before runs were
# concurrent may name a run of another lineage: it is read as that run's pointer and settled like any other.
ACTIVE_RUN = PREFIX + "training_run:active"
ACTIVE_LINEAGE_RUNS = PREFIX + "training_runs:active_lineages"
# Fair share of automatic training (training/scheduler.py): HASH lineage → the virtual finish tag of its last run
# (start-time fair queuing: each run of a lineage adds 1 / its weight), and `FAIR_SHARE_CLOCK` → the start tag of
# the last run started. Written in the claim's EXEC with the run it charges.
FAIR_SHARE = PREFIX + "training:fair_share"
FAIR_SHARE_CLOCK = "@clock"  # no lineage name has an `@`
# HASH line → epoch the scheduler first found the line eligible (fenced scheduler write, removed when the line is
# found not eligible); the claim's EXEC takes the field into the run's `freshness.eligible_wait_seconds`.
ELIGIBLE_SINCE = PREFIX + "training:eligible_since"
# Automatic training (training/scheduler.py): HASH line → epoch its previous Training Run ended (written in the
# run's terminal EXEC), and HASH lineage → JSON {"paused_at"} of the lineages whose automatic training an operator
# paused (kept until resumed: it survives restarts and leader changes).
TRAINING_LAST_END = PREFIX + "training:last_end"
LINEAGES_PAUSED = PREFIX + "lineages:paused"
# Lineages (docs/lineages.md): ZSET lineage → epoch of its first Task, every lineage but `default` (which always
# exists); added in the EXEC that starts that first Task, removed only by the last step of the lineage's deletion
# (docs/lineages.md "Lifecycle"); bounded by `lineages.max_count`.
LINEAGES = PREFIX + "lineages"
# Lineage lifecycle (online/lineage_lifecycle.py): ZSET lineage → epoch of its latest Task start (ZADD GT in that
# start's EXEC; a live lineage only: removed when archived, set again when restored), which the idle sweep reads
# oldest first; ZSET lineage → epoch it was archived or marked for deletion, the lineages whose gateway unload or
# deletion a leader must still finish (the marker a new leader resumes from: an archived lineage leaves it once the
# gateway confirmed the unload, a deleted one in the deletion's last EXEC, with its registry entry).
LINEAGES_LAST_TASK = PREFIX + "lineages:last_task"
LINEAGES_RETIRING = PREFIX + "lineages:retiring"
# The agent-key cap (`agentHmacKeys[i].maxLineages`, docs/security.md): HASH lineage → the agent key that registered
# it, and HASH agent key → how many registered lineages it registered. Invariant: the count of a key equals its
# fields in the first HASH; both change in the EXEC that registers a lineage (under WATCH of `LINEAGES`) and in the
# one that removes it from the registry.
LINEAGES_REGISTERED_BY = PREFIX + "lineages:registered_by"
LINEAGES_COUNT_BY_KEY = PREFIX + "lineages:count_by_key"
# Reward deadlines of lineages (docs/lineages.md): ZSET line → a lower bound of the earliest deadline in that line's
# `reward_deadlines:{line}` (every line but the default one, which the sweeper always visits). Lowered (ZADD LT) in
# the EXEC that adds a deadline; only the sweeper raises or removes an entry, from the line's set in one fenced
# transaction WATCHing that set.
# So the sweeper reads the lines due now, never every registered lineage.
REWARD_DUE_LINES = PREFIX + "rewards:due_lines"
# Automatic training over lineages (training/scheduler.py): ZSET line → the epoch by which the scheduler must judge the
# line again (every line but the default one, which it judges at every tick). Invariant: a non-default line that may
# become eligible has an entry; a line has none only when the scheduler judged it, WATCHing its pending index, unable
# to become eligible without another write that lowers its entry (nothing pending, below its floor, paused, automatic
# training off for it). Lowered (ZADD LT) to a sample's creation epoch in every EXEC that puts a sample into a
# non-default line's pending index (publication, reward arrival or fallback, a run giving samples back) and by a
# resume; the leader's start lowers every registered line once (a changed config is judged anew). The scheduler reads
# the entries due now, never the lines waiting below their threshold, and raises each to its line's next due time
# (the max_wait, interval or quota end; the next tick while a run or rollout holds the line) or removes it.
TRAINING_WAITING = PREFIX + "training:waiting"
# Listing indexes (newest first): ZSETs of ids scored by creation epoch. Tasks are indexed once overall and once
# under their current status. When a record gets its TTL, its id joins a listing-expiry ZSET scored by the epoch
# the record expires; the retention sweeper then removes it from the listing indexes (and listings drop ids whose
# record is gone on the way).
TASKS_BY_CREATION = PREFIX + "tasks:by_created"
RUNS_BY_CREATION = PREFIX + "training_runs:by_created"
TASKS_LISTING_EXPIRY = PREFIX + "tasks:listing_expiry"
RUNS_LISTING_EXPIRY = PREFIX + "training_runs:listing_expiry"
# Listings per lineage (docs/lineages.md "Listings per lineage"): the indexes above hold every lineage's ids, so each
# lineage (`default` included) has its own creation index (`tasks_by_lineage`, `tasks_by_lineage_status`,
# `runs_by_lineage`), written in the same EXEC as the overall one. A record with a TTL whose lineage is not `default`
# has its lineage in a HASH id → lineage, written with its listing-expiry entry, so the sweeper that trims the
# listings (the record gone) knows which lineage index holds the id; no field means `default`. The backfill marker
# holds the progress of the one-time indexing of ids listed before these indexes existed (`done` when finished).
TASKS_LISTING_LINEAGE = PREFIX + "tasks:listing_lineage"
RUNS_LISTING_LINEAGE = PREFIX + "training_runs:listing_lineage"
LISTINGS_LINEAGE_BACKFILL = PREFIX + "listings:lineage_backfill"
POLICY_VERSIONS = PREFIX + "policy_versions"  # SET of policy versions with aggregates (`policy_stats:{version}`)
# SET of the vLLM instance names an operator excluded (issue 28 item 2): their samples are `excluded`, never trained.
EXCLUDED_INSTANCES = PREFIX + "excluded_instances"
# Rollouts (docs/rollout.md): the id of the one rollout not yet ended (absent when none), and every rollout by
# creation epoch. Invariant 10: the pointer names exactly the one non-terminal rollout record.
ROLLOUT_CURRENT = PREFIX + "rollout:current"
ROLLOUTS_BY_CREATION = PREFIX + "rollouts:by_created"
# SET of the non-default lineages whose line has a rollout not ended (docs/lineages.md "Rollout per lineage"): a
# member exactly while `lineage_rollout_current(lineage)` exists (added and removed in the same MULTI as that
# pointer), so a decision round visits the live lines without reading every registered lineage.
ROLLOUT_LIVE_LINEAGES = PREFIX + "rollouts:live_lineages"
# Workers (online/workers/, only with `workers` > 1): the leader lease (STRING `<boot>:<slot>:<pid>:<port>`, PX TTL),
# its fencing epoch (INCR at every acquisition), the boot whose startup recovery is done, the live worker processes
# (ZSET member `<boot>:<slot>:<pid>`, scored by the epoch ms its heartbeat entry expires), and the fault the leader's
# duties report (STRING with a TTL, read by the followers' `GET /health`).
LEADER = PREFIX + "service:leader"
LEADER_EPOCH = PREFIX + "service:leader_epoch"
SERVICE_BOOT = PREFIX + "service:recovered_boot"
WORKERS = PREFIX + "service:workers"
LEADER_FAULT = PREFIX + "service:leader_fault"


def tasks_by_status(status: str) -> str:
    if status not in TASK_STATUSES:
        raise InvalidIdentifier("invalid task status")
    return f"{PREFIX}tasks:by_created:{status}"


def _listing_lineage(lineage: str) -> str:
    # Every lineage, `default` included: the overall listing indexes above are not per lineage.
    if not is_lineage(lineage):
        raise InvalidIdentifier("invalid lineage for a listing index")
    return lineage


def tasks_by_lineage(lineage: str) -> str:
    """One lineage's Task ids (ZSET, score = creation epoch), `default` included."""
    return f"{PREFIX}tasks:by_lineage:{_listing_lineage(lineage)}"


def tasks_by_lineage_status(lineage: str, status: str) -> str:
    """One lineage's Task ids of one status (ZSET, score = creation epoch)."""
    if status not in TASK_STATUSES:
        raise InvalidIdentifier("invalid task status")
    return f"{tasks_by_lineage(lineage)}:{status}"


def runs_by_lineage(lineage: str) -> str:
    """One lineage's Training Run ids (ZSET, score = creation epoch), `default` included."""
    return f"{PREFIX}training_runs:by_lineage:{_listing_lineage(lineage)}"


def policy_stats(version: str) -> str:
    """Per-policy-version aggregates (HASH): tasks, samples, reward sums, sources, tokens, latency buckets."""
    return f"{PREFIX}policy_stats:{require_token_id(version, 'policy version')}"


def _owner(owner: str) -> str:
    # Owners are model ids, validated by the config; still refuse anything that could bend the key space.
    if not owner or any(c.isspace() for c in owner):
        raise InvalidIdentifier("invalid owner")
    return owner


def task(t: str) -> str:
    return f"{PREFIX}task:{require_task_id(t)}"


def active_session(s: str) -> str:
    return f"{PREFIX}active_session:{require_token_id(s, 'session id')}"


def capture(t: str, c: str) -> str:
    return f"{task(t)}:capture:{require_token_id(c, 'capture_id')}"


def captures(t: str) -> str:
    return f"{task(t)}:captures"


def open_captures(t: str) -> str:
    return f"{task(t)}:captures:open"


def committed_captures(t: str) -> str:
    return f"{task(t)}:captures:committed"


def turn_captures(t: str, u: str) -> str:
    return f"{task(t)}:turn:{require_token_id(u, 'agent_turn_id')}:captures"


def turn_current(t: str) -> str:
    return f"{task(t)}:turn:current"


def turn_transition(t: str) -> str:
    return f"{task(t)}:turn:transition"


def turns_closed(t: str) -> str:
    return f"{task(t)}:turns:closed"


def turn_publish(t: str, u: str) -> str:
    return f"{task(t)}:turn:{require_token_id(u, 'agent_turn_id')}:publish"


def turn_publisher(t: str, u: str) -> str:
    """The worker process (`<boot>:<slot>:<pid>`, workers/membership.py) holding a `publishing` claim on turn u."""
    return f"{task(t)}:turn:{require_token_id(u, 'agent_turn_id')}:publisher"


def staged(t: str, c: str) -> str:
    return f"{task(t)}:pending:{require_token_id(c, 'capture_id')}"


def reward(t: str) -> str:
    return f"{task(t)}:reward"


def task_events(t: str) -> str:
    return f"{task(t)}:events"


def traj(sample_id: str) -> str:
    # Rail sample ids are `<trajectory_id>:<step_index>`, which the token-id format admits up to 128 chars.
    if not isinstance(sample_id, str) or not sample_id or len(sample_id) > 300 or any(
        not (ch.isalnum() and ch.isascii()) and ch not in "._:-" for ch in sample_id
    ):
        raise InvalidIdentifier("invalid sample id")
    return f"{PREFIX}traj:{sample_id}"


def prompt_block(digest_hex: str) -> str:
    """A shared block of prompt ids (`store/prompt_blocks.py`), named by its 128-bit chained digest in hex."""
    if not isinstance(digest_hex, str) or len(digest_hex) != 32 or any(c not in "0123456789abcdef" for c in digest_hex):
        raise InvalidIdentifier("invalid prompt block digest")
    return f"{PREFIX}prompt_block:{digest_hex}"


def traj_index(owner: str, status: str) -> str:
    if status not in ALL_SAMPLE_STATUSES:
        raise InvalidIdentifier("invalid sample status")
    return f"{PREFIX}traj_idx:{_owner(owner)}:{status}"


def traj_stats(owner: str) -> str:
    return f"{PREFIX}traj_stats:{_owner(owner)}"


# The fields of a `traj_stats` hash (and `source:` of a `policy_stats` hash), built here only.
STATS_PENDING_POLICY_PREFIX = "pending_policy:"


def stats_status(status: str) -> str:
    return f"status:{status}"


def stats_source(source: str) -> str:
    return f"source:{source}"


def stats_pending_policy(policy_version: str) -> str:
    return f"{STATS_PENDING_POLICY_PREFIX}{policy_version}"


def stats_reward_arrived(source: str) -> str:
    return f"reward_arrived:{source}"


def stats_reward_fallback(source: str) -> str:
    return f"reward_fallback:{source}"


def reward_deadlines(owner: str) -> str:
    """ZSET of `awaiting_rewards` sample ids; score = the earliest deadline (epoch) of a source still open."""
    return f"{PREFIX}reward_deadlines:{_owner(owner)}"


def reward_latency(owner: str, source: str) -> str:
    """LIST of the lateness (seconds after publication) of the last arrivals of one reward source, newest first."""
    if not isinstance(source, str) or not 1 <= len(source) <= 32 or not all(
        (c.isascii() and (c.islower() or c.isdigit())) or c in "_-" for c in source
    ):
        raise InvalidIdentifier("invalid reward source")
    return f"{PREFIX}reward_latency:{_owner(owner)}:{source}"


def pending_judge(s: str, trajectory_id: str, step: int) -> str:
    return (
        f"{PREFIX}pending_judge:{require_token_id(s, 'session_id')}:"
        f"{require_token_id(trajectory_id, 'trajectory_id')}:{int(step)}"
    )


def pending_judge_session(s: str) -> str:
    return f"{PREFIX}pending_judge_session:{require_token_id(s, 'session_id')}"


# HASH session → the worker process (`<boot>:<slot>:<pid>`) that last popped rail samples of that session.
RAIL_INFLIGHT_OWNERS = PREFIX + "rail:inflight_owners"


def rail_inflight(s: str) -> str:
    """Popped rail samples of session s being judged (members and scores of the session index they left)."""
    return f"{PREFIX}rail:inflight:{require_token_id(s, 'session_id')}"


def training_run(r: str) -> str:
    return f"{PREFIX}training_run:{require_run_id(r)}"


def training_run_events(r: str) -> str:
    return f"{training_run(r)}:events"


def rollout(ro: str) -> str:
    """A rollout record (STRING, JSON): a canary of a new version, or an operator's activation of a version."""
    return f"{PREFIX}rollout:{require_rollout_id(ro)}"


def rollout_events(ro: str) -> str:
    return f"{rollout(ro)}:events"


def _lineage_key(lineage: str, suffix: str) -> str:
    """The one builder of a non-default lineage's own keys, `rl:v1:lineage:{lineage}:{suffix}` (docs/lineages.md
    wire 6). The default lineage never comes here: its keys keep their names from before lineages."""
    if not is_lineage(lineage) or lineage == DEFAULT_LINEAGE:
        raise InvalidIdentifier("invalid lineage for a per-lineage key")
    return f"{PREFIX}lineage:{lineage}:{suffix}"


def lineage_state(lineage: str) -> str:
    """A non-default lineage's lifecycle state (STRING, JSON `{"state": "archived" | "deleting", ...}`; absent =
    live). The Task start and the Training Run claim WATCH it, so neither lands on a lineage archived meanwhile."""
    return _lineage_key(lineage, "state")


def rollout_current(lineage: str = DEFAULT_LINEAGE) -> str:
    """The pointer to a line's one rollout not ended: `rollout:current` for the default line (the key AIGW-era
    tooling knows), the lineage's own pointer otherwise. Invariant 10 holds per line."""
    return ROLLOUT_CURRENT if lineage == DEFAULT_LINEAGE else _lineage_key(lineage, "rollout:current")
