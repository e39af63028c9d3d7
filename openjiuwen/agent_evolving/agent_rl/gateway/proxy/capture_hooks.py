"""The gateway's side of the capture hooks (CONTRACT §3.5): send `:before`, `:after` and `:discard` for a captured
call and act on the RL Service's answers (relay a refusal, abort the Task with `capture_failed`). The call's counts are
captured_call.py's: nothing here touches them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from ...common.wire.task_states import FinishReason
from ..rl.rl_client import CaptureFailed, HookUnreachable, RLClient
from ..rl.tasks import TaskTracker
from .captured_call import CapturedCall

if TYPE_CHECKING:
    from ..metrics import GatewayMetrics

log = logging.getLogger("openjiuwen.agent_rl.gateway.inference")


class CaptureHooks:
    def __init__(self, rl: RLClient, tracker: TaskTracker, metrics: "GatewayMetrics | None" = None) -> None:
        self._rl = rl
        self._tracker = tracker
        self._metrics = metrics
        self._background: set[asyncio.Future[Any]] = set()

    def packs_after(self) -> bool:
        return self._rl.packs_after()

    async def before(self, call: CapturedCall, request: dict[str, Any]) -> dict[str, Any]:
        """The injected request `:before` answered; CaptureFailed (the client's answer) when it did not."""
        t = call.binding.rl_task_id
        try:
            answer = await self._rl.before(call.before_body(request))
        except HookUnreachable:
            self._abort_in_background(t)
            raise CaptureFailed("rl_hook_timeout", "the RL Service did not answer the capture hook")
        if answer.ok:
            return answer.json()["request"]
        if answer.status == 404:
            await self._tracker.release(t)
            raise CaptureFailed("completion_conflict", "the RL Task is no longer active")
        if answer.status == 409:
            self._abort_in_background(t)
            raise CaptureFailed(relayed=answer)
        if answer.status >= 500:
            self._abort_in_background(t)
            raise CaptureFailed("rl_hook_failed", "the RL Service failed the capture hook")
        raise CaptureFailed(relayed=answer)  # other 4xx: the Task stays active

    async def after(self, call: CapturedCall, body: bytes, packed: bool) -> None:
        """Commit the capture (`body`: the `:after` JSON, or its packed form); a refusal still gives the client its
        completion, but the Task is aborted."""
        t = call.binding.rl_task_id
        try:
            answer = await self._rl.after(body, packed=packed)
        except HookUnreachable:
            answer = None
        committed = answer is not None and answer.ok
        if self._metrics is not None:
            self._metrics.lineage_capture(call.binding.lineage, "committed" if committed else "refused")
        if not committed:
            log.warning("after hook for task %s failed (%s); aborting it", t,
                        "unreachable" if answer is None else answer.status)
            self._abort_in_background(t)

    async def discard(self, call: CapturedCall) -> None:
        try:
            answer = await self._rl.discard(call.ids_json)
            ok = answer.ok
        except HookUnreachable:
            ok = False
        if self._metrics is not None:
            self._metrics.lineage_capture(call.binding.lineage, "discarded")
        if not ok:
            await self._abort(call.binding.rl_task_id)

    def _abort_in_background(self, rl_task_id: str) -> None:
        self.spawn(self._abort(rl_task_id))

    async def _abort(self, rl_task_id: str) -> None:
        """`:abort capture_failed` and unmap; best effort (the RL Service may be gone)."""
        await self._tracker.release(rl_task_id)
        try:
            await self._rl.abort(rl_task_id, FinishReason.CAPTURE_FAILED)
        except HookUnreachable:
            log.warning("could not abort task %s: RL Service unreachable", rl_task_id)

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        """Wait for the hooks still running (the gateway's shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
