"""One proxied call: the counts it holds and, for a captured call, how its capture ends (CONTRACT §3.5).

Every call holds its instance's requests in flight (least-busy routing) and, on a paging instance, its adapter's use
(no eviction under it) until it is closed: by the handler that returns its answer, or by the stream relay it was
handed over to. A captured call also holds its Task's captures in flight (a Task stop drains them) until its capture
ends, exactly once, in one of three ways:

- committed: `:after` was sent; the count ends when it returns, in its own task (a client that disconnects cannot cut
  it in half, which would leave the RL Service unsure whether the capture was committed);
- discarded: `:before` answered but nothing was committed (upstream error, broken stream, disconnect, an exception):
  `:discard` in a detached task, the count ends when it returns;
- aborted: `:before` never answered (refused, unreachable, an exception first): no hook, the count ends at once.

Closing a call whose capture has not ended ends it as discarded or aborted, whichever applies. A second ending, or a
second close, is a no-op. The hook body's ids are serialized once per call, the request sent upstream once: `:before`,
`:after` and `:discard` splice those bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable
from typing import Any, ContextManager, Protocol

import orjson

from ...common.packed_hook import pack_after
from ..rl.sessions import Binding, SessionMap

COMMITTED = "committed"
DISCARDED = "discarded"
ABORTED = "aborted"


class ProxiedCall:
    """A call outside a Task: only the counts held until it is closed."""

    def __init__(self) -> None:
        self._holds = contextlib.ExitStack()
        self._closed = False
        self._handed_over = False
        self.request_json: bytes | None = None  # the request as sent upstream, serialized once

    def enter_context(self, hold: ContextManager[Any]) -> Any:
        """Hold a count (the instance's in flight, an adapter's use) until the call is closed."""
        return self._holds.enter_context(hold)

    def hand_over(self) -> "ProxiedCall":
        """The stream relay takes the call over: leaving the handler's `with` no longer closes it, the relay does."""
        self._handed_over = True
        return self

    def close(self) -> None:
        """Release every count; synchronous, so that a relay inside a cancelled scope can still do it."""
        if self._closed:
            return
        self._closed = True
        self._holds.close()

    def __enter__(self) -> "ProxiedCall":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._handed_over:
            self.close()


class CaptureHooks(Protocol):
    """Who sends `:after` and `:discard` and acts on their answers (capture_hooks.py); never touches the counts."""

    def packs_after(self) -> bool: ...

    async def after(self, call: "CapturedCall", body: bytes, packed: bool) -> None: ...

    async def discard(self, call: "CapturedCall") -> None: ...

    def spawn(self, coro: Awaitable[Any]) -> "asyncio.Future[Any]": ...


class CapturedCall(ProxiedCall):
    """A call of an active Task's session, counted among the Task's captures in flight from its creation."""

    def __init__(self, sessions: SessionMap, hooks: CaptureHooks, binding: Binding, turn_id: str | None) -> None:
        super().__init__()
        self._sessions = sessions
        self._hooks = hooks
        self.binding = binding
        self.capture_id = "cap-" + uuid.uuid4().hex
        self.turn_id = turn_id
        # The ids every hook body starts with, serialized once for the call's hooks.
        self.ids_json = orjson.dumps({"rl_task_id": binding.rl_task_id, "capture_id": self.capture_id,
                                      "agent_turn_id": turn_id})
        self.request: dict[str, Any] | None = None  # the injected request, once `:before` answered
        self.instance: str | None = None  # the instance that serves it, once routed
        self.ending: str | None = None
        sessions.begin(binding.rl_task_id)

    # ------------------------------------------------------------ hook bodies

    def before_body(self, request: dict[str, Any]) -> bytes:
        return b"".join((self.ids_json[:-1], b',"request":', orjson.dumps(request), b"}"))

    def _head(self) -> bytes:
        # `instance` (ext): the sample records who served it, so that an operator can exclude an instance's samples.
        assert self.request_json is not None, "the request went upstream before `:after`"
        return b"".join((self.ids_json[:-1], b',"instance":', orjson.dumps(self.instance),
                         b',"request":', self.request_json, b"}"))

    def after_body(self, response: dict[str, Any], response_json: bytes | None = None) -> tuple[bytes, bool]:
        """(the `:after` body, whether packed): packed when the running service takes it and the response fits the
        packed form (common/packed_hook.py), else JSON spliced from `response_json` (the upstream's bytes, never
        re-serialized) or, for an aggregated stream, from the response serialized once."""
        head = self._head()
        if self._hooks.packs_after() and (packed := pack_after(head, response)) is not None:
            return packed, True
        spliced = orjson.dumps(response) if response_json is None else response_json
        return b"".join((head[:-1], b',"response":', spliced, b"}")), False

    # ---------------------------------------------------------------- endings

    def captured(self, request: dict[str, Any]) -> None:
        """`:before` answered with the injected `request`: from here the capture ends by `:after` or `:discard`."""
        self.request = request

    async def commit(self, body: bytes, packed: bool) -> None:
        """Ending `committed`: `:after` in its own task, which takes the Task's count over (and ends it)."""
        if self.ending is not None:
            return
        self.ending = COMMITTED  # no await before the task owns the count
        await asyncio.shield(self._hooks.spawn(self._then_end(self._hooks.after(self, body, packed))))

    def discard(self) -> None:
        """Ending `discarded`: `:discard` in a detached task (a stream's relay may be inside a cancelled scope where
        every await fails at once); the Task's count ends when it returns."""
        if self.ending is not None:
            return
        self.ending = DISCARDED
        self._hooks.spawn(self._then_end(self._hooks.discard(self)))

    def abort(self) -> None:
        """Ending `aborted`: no capture to end at the RL Service; the Task's count ends at once."""
        if self.ending is not None:
            return
        self.ending = ABORTED
        self._end_task_count()

    def close(self) -> None:
        """Release the instance's counts; a capture not ended yet is discarded, or aborted before `:before` answered."""
        if self._closed:
            return
        super().close()
        if self.request is not None:
            self.discard()
        else:
            self.abort()

    async def _then_end(self, hook: Awaitable[None]) -> None:
        try:
            await hook
        finally:
            self._end_task_count()

    def _end_task_count(self) -> None:
        # The one place a captured call's Task count ends; `ending` (set once) makes it run once per call.
        self._sessions.end(self.binding.rl_task_id)
