"""The gateway's captured call (gateway/proxy/captured_call.py): each of its three endings releases the Task's and the
instance's in-flight counts exactly once, a second ending is a no-op, and an exception ends it as it should."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.instances.instances import Instance, InstanceRegistry
from openjiuwen.agent_evolving.agent_rl.gateway.lora.holdings import Holdings
from openjiuwen.agent_evolving.agent_rl.gateway.lora.routing import Router
from openjiuwen.agent_evolving.agent_rl.gateway.proxy.captured_call import (
    ABORTED, COMMITTED, DISCARDED, CapturedCall, ProxiedCall,
)
from openjiuwen.agent_evolving.agent_rl.gateway.rl.sessions import Binding, SessionMap

T = "rl-task-1"
INSTANCE = Instance("vllm-0", "m", "127.0.0.1", 8000)
REQUEST = {"model": "m:v1", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class FakeHooks:
    """Records the hooks sent; `gate` holds `:after`/`:discard` open until set."""

    def __init__(self, *, packs: bool = False) -> None:
        self.sent: list[tuple[str, Any]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.packs = packs
        self.background: set[asyncio.Future[Any]] = set()

    def packs_after(self) -> bool:
        return self.packs

    async def after(self, call: CapturedCall, body: bytes, packed: bool) -> None:
        self.sent.append(("after", body))
        await self.gate.wait()

    async def discard(self, call: CapturedCall) -> None:
        self.sent.append(("discard", call.ids_json))
        await self.gate.wait()

    def spawn(self, coro: Any) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def settle(self) -> None:
        while self.background:
            await asyncio.gather(*self.background)


@pytest.fixture
def sessions() -> SessionMap:
    return SessionMap()


@pytest.fixture
def router() -> Router:
    return Router(InstanceRegistry([INSTANCE]), Holdings())


def _call(sessions: SessionMap, hooks: FakeHooks, router: Router) -> CapturedCall:
    call = CapturedCall(sessions, hooks, Binding(T, "sess-1", "m:v1", "m:v1", "terminal"), "turn-1")
    call.enter_context(router.in_flight(INSTANCE))
    return call


def _counts(sessions: SessionMap, router: Router) -> tuple[int, int]:
    return sessions._inflight.get(T, 0), router.in_flight_count(INSTANCE.name)


def _upstream(call: CapturedCall) -> None:
    call.captured(dict(REQUEST, logprobs=True))
    call.instance = INSTANCE.name
    call.request_json = orjson.dumps(call.request)


async def test_committed_releases_both_counts_once(sessions: SessionMap, router: Router) -> None:
    hooks = FakeHooks()
    other = _call(sessions, hooks, router)  # another call of the same Task on the same instance: never released here
    call = _call(sessions, hooks, router)
    assert _counts(sessions, router) == (2, 2)
    _upstream(call)
    await call.commit(*call.after_body({"choices": []}))
    assert call.ending == COMMITTED
    assert _counts(sessions, router) == (1, 2)  # the Task's count ended when `:after` returned
    call.close()
    assert _counts(sessions, router) == (1, 1)
    # A second ending of any kind, or a second close, changes nothing.
    await call.commit(b"{}", False)
    call.discard()
    call.abort()
    call.close()
    await hooks.settle()
    assert _counts(sessions, router) == (1, 1)
    assert [name for name, _ in hooks.sent] == ["after"]
    other.close()
    assert _counts(sessions, router) == (0, 0)


async def test_commit_outlives_a_cancelled_caller(sessions: SessionMap, router: Router) -> None:
    """A client that disconnects during `:after` cancels the handler, not the hook: the Task's count ends only when
    `:after` returns (a Task stop drains it)."""
    hooks = FakeHooks()
    hooks.gate.clear()
    call = _call(sessions, hooks, router)
    _upstream(call)
    handler = asyncio.ensure_future(call.commit(*call.after_body({"choices": []})))
    await asyncio.sleep(0)
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    call.close()
    assert _counts(sessions, router) == (1, 0)
    assert not await sessions.drain(T, 0.01)
    hooks.gate.set()
    assert await sessions.drain(T, 1.0)
    await hooks.settle()
    assert _counts(sessions, router) == (0, 0)
    assert call.ending == COMMITTED and [name for name, _ in hooks.sent] == ["after"]


async def test_discarded_releases_both_counts_once(sessions: SessionMap, router: Router) -> None:
    hooks = FakeHooks()
    hooks.gate.clear()
    other = _call(sessions, hooks, router)
    call = _call(sessions, hooks, router)
    _upstream(call)
    call.close()  # no `:after` (an upstream error, a broken stream, a disconnect): discarded
    assert call.ending == DISCARDED
    assert _counts(sessions, router) == (2, 1)  # the Task's count waits for `:discard` to return
    hooks.gate.set()
    await hooks.settle()
    assert _counts(sessions, router) == (1, 1)
    call.discard()
    call.abort()
    await call.commit(b"{}", False)
    call.close()
    await hooks.settle()
    assert _counts(sessions, router) == (1, 1)
    assert hooks.sent == [("discard", call.ids_json)]
    other.close()
    assert _counts(sessions, router) == (0, 0)


async def test_aborted_before_the_before_hook_answered(sessions: SessionMap, router: Router) -> None:
    hooks = FakeHooks()
    other = _call(sessions, hooks, router)
    call = _call(sessions, hooks, router)
    call.close()  # `:before` refused or unreachable: nothing to end at the RL Service
    assert call.ending == ABORTED
    assert _counts(sessions, router) == (1, 1)
    call.abort()
    call.discard()
    call.close()
    await hooks.settle()
    assert _counts(sessions, router) == (1, 1)
    assert hooks.sent == []
    other.close()
    assert _counts(sessions, router) == (0, 0)


async def test_an_exception_ends_the_call_as_aborted(sessions: SessionMap, router: Router) -> None:
    hooks = FakeHooks()
    with pytest.raises(RuntimeError):
        with _call(sessions, hooks, router) as call:
            raise RuntimeError("boom before `:before` answered")
    assert call.ending == ABORTED
    assert _counts(sessions, router) == (0, 0)
    assert hooks.sent == []


async def test_an_exception_after_before_discards_the_capture(sessions: SessionMap, router: Router) -> None:
    """Once the RL Service holds an open capture, an exception discards it (as a broken upstream does)."""
    hooks = FakeHooks()
    with pytest.raises(RuntimeError):
        with _call(sessions, hooks, router) as call:
            _upstream(call)
            raise RuntimeError("boom after `:before` answered")
    await hooks.settle()
    assert call.ending == DISCARDED
    assert _counts(sessions, router) == (0, 0)
    assert [name for name, _ in hooks.sent] == ["discard"]


async def test_a_handed_over_call_is_closed_by_its_relay_only(sessions: SessionMap, router: Router) -> None:
    hooks = FakeHooks()
    with _call(sessions, hooks, router) as call:
        _upstream(call)
        call.hand_over()  # a stream: the relay closes it when the stream ends
    assert call.ending is None and _counts(sessions, router) == (1, 1)
    call.close()  # the relay's `finally`
    await hooks.settle()
    assert call.ending == DISCARDED and _counts(sessions, router) == (0, 0)


def test_a_call_outside_a_task_releases_its_instance_count_once(router: Router) -> None:
    with ProxiedCall() as call:
        call.enter_context(router.in_flight(INSTANCE))
        assert router.in_flight_count(INSTANCE.name) == 1
    call.close()
    assert router.in_flight_count(INSTANCE.name) == 0


async def test_hook_bodies_share_the_ids_and_the_upstream_request_bytes(sessions: SessionMap, router: Router) -> None:
    """The ids are serialized once per call; `:after` splices the request bytes sent upstream, never re-serialized."""
    hooks = FakeHooks()
    call = _call(sessions, hooks, router)
    ids = {"rl_task_id": T, "capture_id": call.capture_id, "agent_turn_id": "turn-1"}
    assert orjson.loads(call.ids_json) == ids
    assert orjson.loads(call.before_body(REQUEST)) == dict(ids, request=REQUEST)
    _upstream(call)
    call.request_json = b'{"model":"m:v1","sent":"as is"}'  # whatever went upstream, byte for byte
    response = {"choices": [{"index": 0}]}
    body, packed = call.after_body(response, b'{"id":"raw"}')
    assert not packed
    assert body.count(call.request_json) == 1
    assert orjson.loads(body) == dict(ids, instance=INSTANCE.name, request={"model": "m:v1", "sent": "as is"},
                                      response={"id": "raw"})
    body, _ = call.after_body(response)  # an aggregated stream: the response serialized here, once
    assert orjson.loads(body)["response"] == response
    call.close()
    await hooks.settle()
