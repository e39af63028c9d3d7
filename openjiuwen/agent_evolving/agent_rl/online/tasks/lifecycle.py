"""A Task start request's checks, finishing a Task (stop, internal finish), startup recovery and shutdown
(CONTRACT §2.1, §2.4, §2.5, §2.9). Starting and aborting are the registry's own transactions, called directly."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..errors import Conflict, InvalidInput, NotFound
from .. import faults
from ...common.ids import is_task_id, is_token_id, now_iso
from ...common.lineage import DEFAULT_LINEAGE, is_lineage, line_of, version_of
from ...common.policy_names import BASE_POLICY
from ...common.signing_keys import is_agent_key_id
from ...common.wire.task_states import FinishReason, RewardMode, TaskStatus
from .task_records import Task
from .registry import TaskRegistry
from ..store.fence import Fence
from ..capture.turn_ledger import TurnLedger
from ..capture.turns import TurnPublisher

log = logging.getLogger("openjiuwen.agent_rl.online.lifecycle")

_REWARD_MODES = {m.value for m in RewardMode}


@dataclass(frozen=True, slots=True)
class StartHeaders:
    session_id: str | None
    task_id: str | None
    policy_name: str | None
    policy_model: str | None
    agent_key: str | None = None  # X-AIGW-RL-Agent-Key (ext): the agent key starting the Task, absent for operators
    # X-AIGW-RL-Lineage (ext): sent (always, `default` included) only by a gateway that pins Tasks per lineage.
    lineage: str | None = None
    # X-AIGW-RL-Max-Lineages (ext): the agent key's cap on the lineages it registers, sent only with a cap.
    max_lineages: str | None = None


def _blank(value: str | None) -> bool:
    return value is None or not value.strip()


class TaskLifecycle:
    def __init__(
        self,
        registry: TaskRegistry,
        turns: TurnLedger,
        publisher: TurnPublisher,
        *,
        model_id: str,
        judge_configured: bool,
    ) -> None:
        self._registry = registry
        self._turns = turns
        self._publisher = publisher
        self._model_id = model_id
        self._judge_configured = judge_configured

    def parse_start(self, headers: StartHeaders, body: dict[str, Any]) -> Task:
        """The requested Task, or the first failing rule of CONTRACT §2.4 in its order."""
        if _blank(headers.session_id) or not is_token_id(headers.session_id):
            raise InvalidInput("missing_session_id", "X-Agent-Session-Id is missing or invalid")
        if "reward_mode" not in body or not set(body) <= {"reward_mode", "evaluation", "lineage"}:
            raise InvalidInput("invalid_task_request",
                               "body must be {\"reward_mode\": ...} with an optional \"evaluation\": true|false "
                               "and an optional \"lineage\"")
        lineage = body.get("lineage", DEFAULT_LINEAGE)
        if not is_lineage(lineage):
            raise InvalidInput("invalid_lineage", "lineage must be 1-63 of a-z, 0-9 and '-', and not v<digits>")
        evaluation = body.get("evaluation", False)
        if not isinstance(evaluation, bool):
            raise InvalidInput("invalid_task_request", "evaluation must be a boolean")
        mode = body["reward_mode"]
        if not isinstance(mode, str) or mode not in _REWARD_MODES:
            raise InvalidInput("invalid_reward_mode", "reward_mode must be terminal or delayed_feedback")
        if mode == RewardMode.DELAYED_FEEDBACK and not self._judge_configured:
            raise InvalidInput("judge_not_configured", "delayed_feedback Tasks need a configured Judge")
        if _blank(headers.task_id) or _blank(headers.policy_name) or _blank(headers.policy_model):
            raise InvalidInput("invalid_gateway_task", "X-AIGW-RL-* headers must not be blank")
        if not is_task_id(headers.task_id):
            raise InvalidInput("invalid_gateway_task", "X-AIGW-RL-Task-Id has an invalid format")
        if headers.agent_key is not None and not is_agent_key_id(headers.agent_key):
            raise InvalidInput("invalid_gateway_task", "X-AIGW-RL-Agent-Key has an invalid format")
        assert headers.session_id and headers.task_id and headers.policy_name and headers.policy_model
        self._check_lineage(lineage, headers)
        return Task(
            rl_task_id=headers.task_id,
            agent_session_id=headers.session_id,
            model_id=self._model_id,
            policy_lora_name=headers.policy_name,
            reward_mode=mode,
            status=TaskStatus.ACTIVE.value,
            created_at=now_iso(),
            policy_model=headers.policy_model,
            evaluation=evaluation,
            agent_key_id=headers.agent_key,
            lineage=lineage,
        )

    @staticmethod
    def lineage_cap(headers: StartHeaders) -> int | None:
        """The agent key's cap on the lineages it registers, None without one. A malformed value, or one without an
        agent key, is refused (400 `invalid_gateway_task`): never read as "no cap"."""
        raw = headers.max_lineages
        if raw is None:
            return None
        if headers.agent_key is None or not raw.isascii() or not raw.isdigit() or len(raw) > 9:
            raise InvalidInput("invalid_gateway_task",
                               "X-AIGW-RL-Max-Lineages must be a non-negative integer sent with X-AIGW-RL-Agent-Key")
        return int(raw)

    def _check_lineage(self, lineage: str, headers: StartHeaders) -> None:
        """Wire 2 of docs/lineages.md: a non-default lineage needs a gateway that pinned the Task on that lineage's
        line; never a silent fallback onto the default line."""
        if headers.lineage is None:
            if lineage != DEFAULT_LINEAGE:
                raise InvalidInput("lineage_unsupported",
                                   f"lineage {lineage!r} needs a gateway that supports lineages; the gateway in front "
                                   "of this RL Service (no X-AIGW-RL-Lineage header) pins Tasks on the default lineage "
                                   "only")
            return
        if headers.lineage != lineage:
            raise InvalidInput("invalid_lineage", "X-AIGW-RL-Lineage differs from the body's lineage")
        # The policy the gateway pinned must belong to the Task's line, or the samples would train the wrong line.
        # A gateway that sends the header pins per line, so this holds for the default line too; without the header
        # (an AIGW) the default line keeps today's rule (any non-blank name), so an AIGW's policy names are untouched.
        if headers.policy_name != BASE_POLICY \
                and version_of(headers.policy_name, line_of(self._model_id, lineage)) is None:
            raise InvalidInput("invalid_gateway_task",
                               f"x-aigw-rl-policy-name is neither base nor a version of lineage {lineage!r}")

    async def finish(self, rl_task_id: str, reason: FinishReason, *, agent_key: str | None = None) -> Task:
        """Finalize; delayed mode publishes the current turn first (feedback "", tag `session_done`) without
        waiting: open captures are a conflict and the Task stays active. `agent_key`: the calling gateway agent key
        (None for the operator and the service itself): another key's Task is NotFound."""
        task = await self._registry.require(rl_task_id)
        if not task.answers_to(agent_key):
            raise NotFound("RL Task not found")
        if not task.active:
            return task
        if task.delayed:
            current, _ = await self._turns.turn_state(rl_task_id)
            if current is not None:
                await self._publisher.publish(task, current, feedback="", tag="session_done", deadline=None)
        done = await self._registry.finalize(rl_task_id, reason)
        faults.reached("task.finalized")
        return done

    async def recover(self, *, fence: Fence) -> int:
        """Startup: abort every indexed active Task with `service_restarted`; drop stale index entries. A delayed
        Task whose turn publication was cut by the crash first loses what that publication inserted. Every write
        goes through the leader's `fence`: a first leader deposed half way (stopped past its TTL) writes nothing
        more once the next one recovers the boot."""
        aborted = 0
        for t in await self._registry.active_ids():
            task = await self._registry.get(t)
            if task is None or not task.active:
                await self._registry.drop_stale_active(t, fence=fence)
                continue
            if task.delayed:
                await self._publisher.abandon(t, fence=fence)
            await self._registry.abort(t, FinishReason.SERVICE_RESTARTED, fence=fence)
            aborted += 1
        if aborted:
            log.info("startup recovery aborted %d active task(s) with service_restarted", aborted)
        return aborted

    async def shutdown(self) -> None:
        """Finish every active Task with `service_stopped`, else abort it; one failure never stops the loop."""
        try:
            ids = await self._registry.active_ids()
        except Exception:
            log.exception("shutdown could not list active tasks")
            return
        log.info("shutdown: finishing %d active task(s) with service_stopped", len(ids))
        for t in ids:
            try:
                await self.finish(t, FinishReason.SERVICE_STOPPED)
                continue
            except Conflict as exc:
                log.info("task %s could not finish at shutdown (%s); aborting it", t, exc, extra={"rl_task_id": t})
            except Exception:
                log.exception("task %s could not finish at shutdown; aborting it", t, extra={"rl_task_id": t})
            try:
                await self._registry.abort(t, FinishReason.SERVICE_STOPPED)
            except Exception:
                log.exception("task %s could not be aborted at shutdown", t, extra={"rl_task_id": t})
