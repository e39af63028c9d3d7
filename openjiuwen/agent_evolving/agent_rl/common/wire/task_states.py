"""The Task values that cross the wire (CONTRACT §4.1): a Task record's `status` and `finish_reason`, the
`reward_mode` of a Task start, the reason of an internal abort. The RL Service's transition table stays in
online/tasks/task_records.py over these values."""

from __future__ import annotations

from enum import StrEnum


class TaskStatus(StrEnum):
    ACTIVE = "active"
    FINALIZED = "finalized"
    ABORTED = "aborted"


TASK_STATUSES: tuple[TaskStatus, ...] = tuple(TaskStatus)
ENDED_TASK_STATUSES = frozenset({TaskStatus.FINALIZED, TaskStatus.ABORTED})


class FinishReason(StrEnum):
    USER_STOPPED = "user_stopped"
    SERVICE_STOPPED = "service_stopped"
    CAPTURE_FAILED = "capture_failed"
    TIMEOUT = "timeout"
    SERVICE_RESTARTED = "service_restarted"


class RewardMode(StrEnum):
    TERMINAL = "terminal"
    DELAYED_FEEDBACK = "delayed_feedback"
