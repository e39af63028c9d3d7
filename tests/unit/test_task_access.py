"""LineageGuard (gateway/rl/task_access.py): an agent key's lineage limit on Task stop and reward, checked after the
own-Task rule so that a 403 only ever names the caller's own Task."""

from __future__ import annotations

import httpx
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.rl.rl_client import RLAnswer
from openjiuwen.agent_evolving.agent_rl.gateway.rl.sessions import Binding, SessionMap
from openjiuwen.agent_evolving.agent_rl.gateway.rl.task_access import LineageGuard

LIMITS = {"agent-a": frozenset({"support"}), "agent-none": frozenset()}


class FakeReader:
    """The RL Service's Task records by id; `error` raised instead when set."""

    def __init__(self, records: dict[str, dict] | None = None, error: Exception | None = None,
                 status: int = 200) -> None:
        self.records = records or {}
        self.error = error
        self.status = status
        self.reads: list[str] = []

    async def forward(self, method: str, path: str, **_: object) -> RLAnswer:
        self.reads.append(path)
        if self.error is not None:
            raise self.error
        task = path.rsplit("/", 1)[1]
        if task not in self.records:
            return RLAnswer(404, b'{"error":{"code":"task_not_found","message":"x"}}', "application/json")
        return RLAnswer(self.status, orjson.dumps(self.records[task]), "application/json")


def bound(*bindings: Binding) -> SessionMap:
    sessions = SessionMap()
    for binding in bindings:
        sessions.bind(binding)
    return sessions


def binding(task: str, lineage: str, agent_key: str | None = "agent-a") -> Binding:
    return Binding(rl_task_id=task, session_id=f"s-{task}", policy_name="base", policy_model="tiny",
                   reward_mode="terminal", agent_key=agent_key, lineage=lineage)


def code(answer) -> tuple[int, str] | None:
    return None if answer is None else (answer.status_code, orjson.loads(answer.body)["error"]["code"])


async def test_a_bound_task_of_another_lineage_is_refused_without_asking_the_rl_service() -> None:
    reader = FakeReader()
    guard = LineageGuard(LIMITS, bound(binding("t1", "coding"), binding("t2", "support")), reader)
    assert code(await guard.refusal("t1", "agent-a")) == (403, "lineage_forbidden")
    assert await guard.refusal("t2", "agent-a") is None
    assert reader.reads == []


async def test_another_keys_task_and_unlimited_callers_are_left_to_the_own_task_rule() -> None:
    guard = LineageGuard(LIMITS, bound(binding("t1", "coding", agent_key="agent-b")), FakeReader())
    assert await guard.refusal("t1", "agent-a") is None  # unknown to agent-a downstream, never a 403
    assert await guard.refusal("t1", "agent-b") is None  # no limit
    assert await guard.refusal("t1", None) is None  # the operator


async def test_an_unbound_task_is_judged_by_its_rl_record_and_default_when_absent() -> None:
    reader = FakeReader({"t1": {"agent_key_id": "agent-a", "lineage": "coding"},
                         "t2": {"agent_key_id": "agent-a"},
                         "t3": {"agent_key_id": "agent-a", "lineage": "support"},
                         "t4": {"agent_key_id": "agent-b", "lineage": "coding"}})
    guard = LineageGuard(LIMITS, SessionMap(), reader)
    assert code(await guard.refusal("t1", "agent-a")) == (403, "lineage_forbidden")
    assert code(await guard.refusal("t2", "agent-a")) == (403, "lineage_forbidden")  # no field: `default`
    assert await guard.refusal("t3", "agent-a") is None
    assert await guard.refusal("t4", "agent-a") is None  # another key's: the RL Service answers it unknown
    assert await guard.refusal("t9", "agent-a") is None  # unknown stays the RL Service's 404
    assert reader.reads == [f"/v1/rl/tasks/t{n}" for n in (1, 2, 3, 4, 9)]


async def test_an_empty_limit_allows_no_task() -> None:
    guard = LineageGuard(LIMITS, bound(binding("t1", "default", agent_key="agent-none")), FakeReader())
    assert code(await guard.refusal("t1", "agent-none")) == (403, "lineage_forbidden")


@pytest.mark.parametrize(("reader", "expected"), [
    (FakeReader(error=httpx.ConnectError("down")), (503, "rl_service_unavailable")),
    (FakeReader(error=httpx.ReadTimeout("slow")), (504, "rl_service_timeout")),
    (FakeReader({"t1": {"agent_key_id": "agent-a"}}, status=500), (503, "rl_service_unavailable")),
])
async def test_an_unreadable_record_fails_closed(reader: FakeReader, expected: tuple[int, str]) -> None:
    assert code(await LineageGuard(LIMITS, SessionMap(), reader).refusal("t1", "agent-a")) == expected
