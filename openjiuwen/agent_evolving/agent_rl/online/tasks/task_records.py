"""Task and capture records, and their state machines as data (CONTRACT §4.1, §4.2, §4.3, §4.4). The Task values
that cross the wire (status, finish reason, reward mode) are common/wire/task_states.py's."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

import orjson

from ...common.lineage import DEFAULT_LINEAGE, line_of
from ...common.wire.task_states import FinishReason, RewardMode, TaskStatus
from ..errors import NotFound
from ..transitions import Transitions


class CaptureStatus(StrEnum):
    OPEN = "open"
    COMMITTED = "committed"


# Terminal states are sticky: finishing or aborting again returns the stored record unchanged (the registry reads
# the record first), so a move out of them is a bug and raises.
TASK_TRANSITIONS = Transitions("task", {
    TaskStatus.ACTIVE: {TaskStatus.FINALIZED, TaskStatus.ABORTED},
    TaskStatus.FINALIZED: set(),
    TaskStatus.ABORTED: set(),
})


class TurnPublication(StrEnum):
    """A delayed-feedback turn's publication (`turn:{u}:publish`, CONTRACT §4.3). The first three are stored; a
    claim (`TaskRegistry.claim_publish`) answers one of them or one of the last two, which are never stored."""

    PUBLISHING = "publishing"
    PUBLISHED = "published"
    FAILED = "failed"
    CLAIMED = "claimed"  # this caller took the claim (the stored state is now `publishing`) and must publish
    OPEN = "open"  # captures of the Task are still open: wait and claim again


# A claim writes `publishing` where nothing is stored yet.
TURN_PUBLICATION_TRANSITIONS = Transitions("turn publication", {
    TurnPublication.PUBLISHING: {TurnPublication.PUBLISHED, TurnPublication.FAILED},
    TurnPublication.PUBLISHED: set(),
    TurnPublication.FAILED: set(),
})


class TerminalReward(StrEnum):
    """The `status` of a terminal-mode Task's reward record (`task:{t}:reward`, CONTRACT §4.4)."""

    PROJECTING = "projecting"  # claimed with its value: the staged samples are being copied into the store
    PUBLISHED = "published"
    EXPIRED = "expired"  # no reward came within the reward window: the staged samples were dropped


# A reward call writes `projecting`, the retention sweeper `expired`, where nothing is stored yet.
TERMINAL_REWARD_TRANSITIONS = Transitions("terminal reward", {
    TerminalReward.PROJECTING: {TerminalReward.PUBLISHED},
    TerminalReward.PUBLISHED: set(),
    TerminalReward.EXPIRED: set(),
})


@dataclass(frozen=True, slots=True)
class Task:
    rl_task_id: str
    agent_session_id: str
    model_id: str
    policy_lora_name: str
    reward_mode: str
    status: str
    created_at: str
    finished_at: str | None = None
    finish_reason: str | None = None
    policy_model: str = ""
    # An evaluation Task: its samples are measured (per-version evaluation) but never trained on.
    evaluation: bool = False
    # The gateway agent key that started the Task (ext, X-AIGW-RL-Agent-Key); None for the operator key or an AIGW.
    # Only that key may stop or reward it.
    agent_key_id: str | None = None
    # The lineage whose line the Task's policy and samples belong to (docs/lineages.md). Stored and answered only
    # when not `default`, so the default lineage's records stay byte-for-byte what they were before lineages.
    lineage: str = DEFAULT_LINEAGE

    def __post_init__(self) -> None:
        if not self.policy_model:
            object.__setattr__(self, "policy_model", self.policy_lora_name)

    @property
    def active(self) -> bool:
        return self.status == TaskStatus.ACTIVE

    @property
    def delayed(self) -> bool:
        return self.reward_mode == RewardMode.DELAYED_FEEDBACK

    @property
    def line(self) -> str:
        return line_of(self.model_id, self.lineage)

    def spec(self) -> tuple[str, str, str, str, str, bool, str | None, str]:
        return (self.agent_session_id, self.model_id, self.policy_lora_name, self.reward_mode, self.policy_model,
                bool(self.evaluation), self.agent_key_id, self.lineage)

    def answers_to(self, agent_key_id: str | None) -> bool:
        """Whether a caller may stop or reward this Task: the operator (None) any Task, an agent key only its own."""
        return agent_key_id is None or agent_key_id == self.agent_key_id

    def terminal(self, status: TaskStatus, reason: FinishReason, at: str) -> "Task":
        TASK_TRANSITIONS.check(self.status, status)
        return replace(self, status=status.value, finish_reason=reason.value, finished_at=at)

    def public(self) -> dict[str, Any]:
        data = asdict(self)
        if self.lineage == DEFAULT_LINEAGE:
            del data["lineage"]
        return data

    def to_json(self) -> bytes:
        return orjson.dumps(self.public(), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Task":
        data = orjson.loads(raw)
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True, slots=True)
class CaptureMeta:
    capture_id: str
    agent_turn_id: str | None
    request_fingerprint: str
    response_fingerprint: str | None
    status: str
    created_at: str
    # The samples a committed capture made when it made more than one (one per choice of an `n` > 1 answer: the
    # capture id, then `<capture id>.1` …); absent from the JSON otherwise, so a capture of one choice keeps the
    # encoding it always had.
    samples: int | None = None

    def to_json(self) -> bytes:
        # What `asdict` gives, without its per-field deep copies (every field is a str, an int or None): written on
        # every hook.
        fields = {name: getattr(self, name) for name in _CAPTURE_FIELDS}
        if self.samples is None:
            del fields["samples"]
        return orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "CaptureMeta":
        data = orjson.loads(raw)
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})


_CAPTURE_FIELDS = tuple(CaptureMeta.__dataclass_fields__)


async def read_task(pipe: Any, task_key: str) -> Task:
    """The Task record read inside an optimistic transaction (a WATCHing pipeline); NotFound when it is gone."""
    raw = await pipe.get(task_key)
    if raw is None:
        raise NotFound("RL Task not found")
    return Task.from_json(raw)
