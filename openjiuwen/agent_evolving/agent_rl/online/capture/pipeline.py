"""The capture hooks `:before`, `:after` and `:discard` (CONTRACT §2.8, §4.2, §4.3).

Each hook parses its body once, validates against the Task's immutable facts (remembered per process,
`CaptureLedger.task_facts`), and touches Redis in one script round trip (two for a commit whose reservation another
process made); the scripts check the Task's existence, identity and live status. Abort rules: at `:before` input
errors, model mismatch, capture-id reuse and "another turn waiting" leave the Task active, while a closed or closing
turn and a failed or timed-out publication abort it; at `:after` every rejection past the body shape aborts it.
`:after` does not validate or normalize again a request that is exactly the one this process injected at `:before`
(`_as_reserved`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from ...common.packed_hook import PackedArrays
from ..errors import Conflict, InvalidInput, invalid_completion
from .. import faults
from ..judge import feedback_from_request
from ...common.wire.task_states import FinishReason
from ..tasks.task_records import Task
from ..tasks.registry import TaskRegistry
from .hook_body import HookBody, parse_hook
from .ledger import AbortingConflict, CaptureLedger, ReserveOutcome
from .request import (
    RequestModelMismatch,
    normalize_request,
    packed_response_fingerprint,
    request_fingerprint,
    response_fingerprint,
    validate_request,
)
from .response import ResponseModelMismatch, validate_packed_response, validate_response
from .sample import build_samples
from .turn_ledger import TurnLedger
from .turns import TurnPublisher


log = logging.getLogger("openjiuwen.agent_rl.online.capture")


class CapturePipeline:
    def __init__(
        self,
        registry: TaskRegistry,
        ledger: CaptureLedger,
        turns: TurnLedger,
        publisher: TurnPublisher,
        *,
        turn_publish_timeout_s: float,
    ) -> None:
        self._registry = registry  # a Task's abort only
        self._ledger = ledger
        self._turns = turns
        self._publisher = publisher
        self._turn_publish_timeout_s = turn_publish_timeout_s

    async def before(self, body: dict[str, Any]) -> dict[str, Any]:
        """Reserve a capture; the injected request. May raise StaleTask (nothing written): call again."""
        hook = parse_hook(body, with_request=True, with_response=False)
        task, cached = await self._ledger.task_facts(hook.rl_task_id)
        try:
            try:
                validate_request(
                    hook.request, policy_model=task.policy_model, delayed=task.delayed,
                    agent_turn_id=hook.agent_turn_id,
                )
            except RequestModelMismatch as exc:
                raise Conflict(str(exc)) from exc
            injected = normalize_request(hook.request)
            fp = request_fingerprint(injected)
        except (InvalidInput, Conflict):
            if cached:  # what the Task read the facts replaced would have answered first
                await self._ledger.confirm(task)
            raise
        deadline = asyncio.get_running_loop().time() + self._turn_publish_timeout_s
        while True:
            try:
                reservation = await self._ledger.reserve(task, hook.capture_id, hook.agent_turn_id, fp)
            except AbortingConflict:
                await self._registry.abort(task.rl_task_id, FinishReason.CAPTURE_FAILED)
                raise
            if reservation.outcome is not ReserveOutcome.PUBLISH_CURRENT:
                return injected
            # Delayed mode: this request opens the next turn, so the current one is published first with this
            # request's user message as its feedback; then the turn advances and the reservation is retried.
            current = reservation.current_turn
            assert current is not None and hook.agent_turn_id is not None
            await self._publisher.publish(
                task, current, feedback=feedback_from_request(injected), tag="feedback", deadline=deadline
            )
            faults.reached("turn.published")
            await self._turns.advance_turn(task.rl_task_id, current, hook.agent_turn_id)

    def after(self, body: dict[str, Any]) -> Awaitable[bool]:
        """Commit a capture; True when this call committed it (False for an idempotent repeat). May raise
        StaleTask (nothing written): call again with the body parsed anew (this call drops the parsed one).

        A plain function that hands `_commit` the only reference to the parsed body: an `async def` here would
        keep its own frame's reference to the response alive until the commit's Redis round trip returned."""
        return self._commit(parse_hook(body, with_request=True, with_response=True), None)

    def after_packed(self, head: dict[str, Any], arrays: PackedArrays) -> Awaitable[bool]:
        """`after` for a packed body (common/packed_hook.py): the JSON part, and the arrays as they came."""
        return self._commit(parse_hook(head, with_request=True, with_response=True), arrays)

    async def _commit(self, hook: HookBody, arrays: PackedArrays | None) -> bool:
        task, cached = await self._ledger.task_facts(hook.rl_task_id)
        try:
            try:
                injected, request_fp = self._as_reserved(task, hook)
                try:
                    if injected is None:  # not (or not provably) the request `:before` injected: checked as new
                        validate_request(
                            hook.request, policy_model=task.policy_model, delayed=task.delayed,
                            agent_turn_id=hook.agent_turn_id,
                        )
                    n = hook.request.get("n") or 1  # validated: absent, null or a positive integer
                    if arrays is None:
                        validated = validate_response(hook.response, policy_model=task.policy_model, n=n)
                    elif n > 1:
                        raise invalid_completion("a packed body carries one choice; send request.n > 1 as JSON")
                    else:
                        validated = validate_packed_response(hook.response, arrays, policy_model=task.policy_model)
                except (RequestModelMismatch, ResponseModelMismatch) as exc:
                    raise Conflict(str(exc)) from exc
                if injected is None:
                    injected = normalize_request(hook.request)
                    request_fp = request_fingerprint(injected)
                samples = build_samples(
                    task, capture_id=hook.capture_id, agent_turn_id=hook.agent_turn_id, request=injected,
                    response=hook.response, validated=validated, instance=hook.instance,
                )
                fingerprints = request_fp, (
                    response_fingerprint(hook.response) if arrays is None
                    else packed_response_fingerprint(hook.response, arrays)
                )
            except (InvalidInput, Conflict):
                if cached:  # what the Task read the facts replaced would have answered first
                    await self._ledger.confirm(task)
                raise
            # The parsed response (~20k objects for 2,048 tokens, logprob entries included) is not needed past
            # this point: dropped here, the collector never walks it while the commit waits on Redis.
            hook = HookBody(hook.rl_task_id, hook.capture_id, hook.agent_turn_id)
            del validated, arrays
            committed = await self._ledger.commit(
                task, hook.capture_id, hook.agent_turn_id, *fingerprints, samples,
            )
            faults.reached("capture.committed")
            return committed
        except (InvalidInput, Conflict) as exc:
            log.warning("capture %s of task %s rejected at after: %s", hook.capture_id, task.rl_task_id, exc,
                        extra={"rl_task_id": task.rl_task_id, "capture_id": hook.capture_id,
                               "agent_turn_id": hook.agent_turn_id})
            await self._registry.abort(task.rl_task_id, FinishReason.CAPTURE_FAILED)
            raise

    def _as_reserved(self, task: Task, hook: HookBody) -> tuple[dict[str, Any] | None, str | None]:
        """(the request, its fingerprint) when `:after` carries exactly the request this process injected and
        fingerprinted at `:before` for this capture and turn, else (None, None). That request was validated and
        normalized then, and normalizing is idempotent, so both would answer the same again: they are skipped. The
        checks that depend on the Task's facts are repeated (cheap; a Task id started anew may have other facts).
        Anything else (another worker reserved it, a changed request, a request that cannot be fingerprinted) takes
        the full path, and the commit script still compares the stored fingerprint."""
        if hook.request.get("model") != task.policy_model or (task.delayed and hook.agent_turn_id is None):
            return None, None
        reserved = self._ledger.reserved_fingerprint(hook.rl_task_id, hook.capture_id, hook.agent_turn_id)
        if reserved is None:
            return None, None
        try:
            fp = request_fingerprint(hook.request)
        except InvalidInput:
            return None, None
        return (hook.request, fp) if fp == reserved else (None, None)

    async def discard(self, body: dict[str, Any]) -> bool:
        """Drop an open capture; True when this call dropped one. The script checks the Task exists (404)."""
        hook = parse_hook(body, with_request=False, with_response=False)
        return await self._ledger.discard(hook.rl_task_id, hook.capture_id, hook.agent_turn_id)
