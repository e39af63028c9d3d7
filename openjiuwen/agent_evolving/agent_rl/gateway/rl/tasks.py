"""Task pinning on the gateway side: session mappings and the LoRA leases that keep a pinned version loaded
(CONTRACT §3.4). A lease is taken before the Task start is forwarded and released exactly once, when the gateway
sees the Task end (or the RL Service stop or fail)."""

from __future__ import annotations

import logging
from typing import Protocol

from ...common.policy_names import BASE_POLICY
from .sessions import Binding, SessionMap

log = logging.getLogger("openjiuwen.agent_rl.gateway.tasks")


class LeaseHolder(Protocol):
    """Who keeps a pinned version loaded while Tasks hold it (the LoRA manager)."""

    def acquire(self, lora_name: str) -> None: ...

    async def release(self, lora_name: str) -> None: ...


class TaskTracker:
    def __init__(self, sessions: SessionMap, leases: LeaseHolder) -> None:
        self.sessions = sessions
        self._leases = leases

    def lease(self, policy_name: str) -> None:
        if policy_name != BASE_POLICY:
            self._leases.acquire(policy_name)

    async def unlease(self, policy_name: str) -> None:
        if policy_name != BASE_POLICY:
            await self._leases.release(policy_name)

    async def adopt(self, binding: Binding, *, leased_policy: str | None) -> None:
        """Map a started Task. `leased_policy` is the lease taken before forwarding: it becomes the Task's when the
        policies match; otherwise it is dropped and the Task's own policy is leased (once per Task)."""
        if self.sessions.for_task(binding.rl_task_id) is not None:
            if leased_policy is not None:
                await self.unlease(leased_policy)  # the Task already holds its lease (a repeated start)
            self.sessions.bind(binding)
            return
        if leased_policy != binding.policy_name:
            self.lease(binding.policy_name)
            if leased_policy is not None:
                await self.unlease(leased_policy)
        self.sessions.bind(binding)

    async def release(self, rl_task_id: str) -> None:
        """The Task ended (or is gone): unmap its session and release its lease. Idempotent."""
        binding = self.sessions.unbind_task(rl_task_id)
        if binding is not None:
            log.info("task %s released (policy %s)", rl_task_id, binding.policy_name)
            await self.unlease(binding.policy_name)

    async def release_all(self) -> None:
        for rl_task_id in self.sessions.all_tasks():
            await self.release(rl_task_id)

    async def service_exited(self, reason: str) -> None:
        """The RL Service child exited without a stop request (the supervisor's `on_exit`): every Task is over."""
        log.error("RL Service exited unexpectedly (%s); captures bypass it until it is started again", reason)
        await self.release_all()
