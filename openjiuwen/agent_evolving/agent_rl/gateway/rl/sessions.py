"""Which agent session belongs to which active Task, and the captures in flight per Task (CONTRACT §3.4, §3.5).

A capture counts as in flight from `:before` until `:after`/`:discard` returns; stop drains wait on that count.
Single event loop, no locks: every mutation happens between awaits.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ...common.lineage import DEFAULT_LINEAGE


@dataclass(frozen=True, slots=True)
class Binding:
    rl_task_id: str
    session_id: str
    policy_name: str  # "base" or "<model>:vN"
    policy_model: str  # the model name requests are rewritten to
    reward_mode: str
    # The id of the agent key that started the Task (the RL Service's record says so), None for the operator key.
    agent_key: str | None = None
    # The lineage the Task's start was forwarded with (docs/lineages.md): an agent key's lineage limit applies to it.
    lineage: str = DEFAULT_LINEAGE
    # SHA-256 of the Task's capture secret (auth/capture_secret.py), or None: the session id alone captures. Kept here
    # so that it lives and dies with the mapping it guards (never persisted: after a gateway restart the Task is gone).
    secret_digest: bytes | None = field(default=None, repr=False)


class SessionMap:
    def __init__(self) -> None:
        self._by_session: dict[str, Binding] = {}
        self._by_task: dict[str, Binding] = {}
        self._inflight: dict[str, int] = {}
        self._drained: dict[str, asyncio.Event] = {}

    def bind(self, binding: Binding) -> None:
        old = self._by_session.get(binding.session_id)
        if old is not None and old.rl_task_id != binding.rl_task_id:
            self._by_task.pop(old.rl_task_id, None)
        self._by_session[binding.session_id] = binding
        self._by_task[binding.rl_task_id] = binding

    def for_session(self, session_id: str | None) -> Binding | None:
        return None if session_id is None else self._by_session.get(session_id)

    def for_task(self, rl_task_id: str) -> Binding | None:
        return self._by_task.get(rl_task_id)

    def unbind_task(self, rl_task_id: str) -> Binding | None:
        """Forget a Task's mapping; returns it (its lease is the caller's to release)."""
        binding = self._by_task.pop(rl_task_id, None)
        if binding is not None and self._by_session.get(binding.session_id) == binding:
            del self._by_session[binding.session_id]
        return binding

    def all_tasks(self) -> list[str]:
        return list(self._by_task)

    # ------------------------------------------------------------ in flight

    def begin(self, rl_task_id: str) -> None:
        self._inflight[rl_task_id] = self._inflight.get(rl_task_id, 0) + 1

    def end(self, rl_task_id: str) -> None:
        left = self._inflight.get(rl_task_id, 0) - 1
        if left > 0:
            self._inflight[rl_task_id] = left
            return
        self._inflight.pop(rl_task_id, None)
        event = self._drained.pop(rl_task_id, None)
        if event is not None:
            event.set()

    async def drain(self, rl_task_id: str, timeout_s: float) -> bool:
        """True once the Task has no capture in flight; False when `timeout_s` passes first."""
        if not self._inflight.get(rl_task_id):
            return True
        event = self._drained.setdefault(rl_task_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=timeout_s)
            return True
        except TimeoutError:
            return False
