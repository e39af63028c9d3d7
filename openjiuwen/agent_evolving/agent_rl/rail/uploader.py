"""rail-v1 uploads from an agent process (CONTRACT §2.9, §4.6): a bounded queue, per-session batches, retries.

An agent submits *items*: one step sample of a session (its `step_index` required), optionally carrying the user's
feedback on the previous reply (`prev_feedback`) and/or the end of the session (`session_done`); an item may also
carry only the feedback or only the end. The uploader groups consecutive items of one session into rail-v1 batches
and posts them to `POST /v1/gateway/upload/batch` of a gateway (HMAC-signed with `sign_key`, the agent's own agent
key) or of an RL Service directly (`bearer` = its `RL_SERVICE_TOKEN`).

**Order.** Each session has a lane drained by one sender task, so a session's batches go one at a time, in
submission order, and a batch never overtakes the one before it, retries included. Different sessions are sent
concurrently, at most `max_in_flight` requests at once.

**Batches.** A batch holds consecutive items of one session and trajectory. A new batch starts at an item with
`prev_feedback` (the service applies the feedback before staging the batch's samples, so it must lead), at a new
trajectory or `trajectory_meta`, at a repeated `step_index`, and after `max_batch` samples; `session_done` ends one.
A batch is sent once complete, or `flush_interval_s` after its oldest item was submitted, or at once during
`flush()`/`close()`.

**Back-pressure.** `max_queue` bounds the items accepted and not yet settled (queued or in flight). `submit` waits
for room, in arrival order; `try_submit` returns False instead (also while a `submit` is waiting).

**Retries.** Transport errors (timeouts included), 429 and 5xx are retried up to `max_retries` times, after
`backoff_first_s`, doubling up to `backoff_cap_s`, each delay jittered down to half (a longer `Retry-After` is
honoured up to the cap). Re-sending is safe: the service names samples `<trajectory_id>:<step_index>` and never
stores one twice. One limit of rail-v1: if an attempt carrying `prev_feedback` reached the service and only its
answer was lost, the retry applies the feedback to the next staged sample as well (feedback has no idempotency key).
Any other 4xx means the batch (or the credential) is wrong: logged, counted in `dropped`, never retried.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections import deque
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from ..common.hmac_signing import HmacAuth
from ..common.signing_keys import SigningKey

log = logging.getLogger("openjiuwen.agent_rl.rail.uploader")

PROTOCOL_VERSION = "rail-v1"
UPLOAD_PATH = "/v1/gateway/upload/batch"
MAX_STEP_INDEX = 2**31 - 1
_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # rail session and trajectory ids (CONTRACT conventions)


class UploaderClosed(RuntimeError):
    """The uploader is closed: nothing more can be submitted."""


@dataclass(slots=True)
class UploaderMetrics:
    """Counters since construction. Batches: `sent` (answered 2xx), `retried` (extra attempts), `failed` (given
    up after `max_retries` transient failures), `dropped` (refused with a 4xx). Samples: `samples_sent` (in sent
    batches), `samples_lost` (in failed or dropped batches, or discarded by `close(flush=False)`), and from the
    service's answers `rejected` (invalid samples) and `judge_failed` (not stored: the Judge could not score them)."""

    sent: int = 0
    retried: int = 0
    failed: int = 0
    dropped: int = 0
    samples_sent: int = 0
    samples_lost: int = 0
    rejected: int = 0
    judge_failed: int = 0


def check_id(name: str, value: object) -> str:
    """`value` when it is a rail session/trajectory id (`[A-Za-z0-9._:-]{1,128}`); else ValueError."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ValueError(f"{name} must match [A-Za-z0-9._:-]{{1,128}}")
    return value


def upload_url(endpoint: str) -> str:
    """The upload URL for a gateway or RL Service base URL (a URL already ending in the upload path is kept)."""
    url = endpoint.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("endpoint must be an http(s) URL")
    if parts.username is not None or parts.password is not None:
        raise ValueError("endpoint must not carry credentials: use sign_key or bearer")
    return url if url.endswith(UPLOAD_PATH) else url + UPLOAD_PATH


@dataclass(frozen=True, slots=True)
class _Item:
    session_id: str
    trajectory_id: str
    sample: dict[str, Any] | None
    prev_feedback: str | None
    session_done: bool
    trajectory_meta: dict[str, Any] | None
    submitted_at: float  # event-loop time

    @property
    def step(self) -> int | None:
        return None if self.sample is None else self.sample["step_index"]


@dataclass(slots=True)
class _Lane:
    items: deque[_Item] = field(default_factory=deque)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class _Slots:
    """A FIFO counting gate: `take` waits in arrival order; `give` hands a freed slot straight to the oldest waiter,
    so a later caller can never overtake one that is waiting."""

    def __init__(self, capacity: int) -> None:
        self._free = capacity
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    def try_take(self) -> bool:
        if self._closed:
            raise UploaderClosed("the uploader is closed")
        if self._waiters or self._free == 0:
            return False
        self._free -= 1
        return True

    async def take(self) -> None:
        if self.try_take():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # resolved by give() (the slot is ours) or failed by close()
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.give(1)  # handed over just as we were cancelled: pass it on
            else:
                with suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def give(self, count: int) -> None:
        for _ in range(count):
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    break
            else:
                self._free += 1

    def close(self) -> None:
        self._closed = True
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(UploaderClosed("the uploader was closed while waiting for room"))


def _batch_extent(items: deque[_Item], max_batch: int) -> tuple[int, bool]:
    """(number of leading items forming the next batch, whether that batch is complete)."""
    first = items[0]
    steps: set[int] = set()
    for position, item in enumerate(items):
        if position and (
            item.prev_feedback is not None  # feedback applies before a batch's samples: it must lead one
            or item.trajectory_id != first.trajectory_id
            or item.trajectory_meta != first.trajectory_meta
        ):
            return position, True
        step = item.step
        if step is not None:
            if len(steps) == max_batch or step in steps:  # the service refuses a step repeated in one batch
                return position, True
            steps.add(step)
        if item.session_done:
            return position + 1, True
    return len(items), len(steps) >= max_batch


def _batch_body(items: list[_Item]) -> dict[str, Any]:
    first = items[0]
    body: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "session_id": first.session_id,
        "trajectory_id": first.trajectory_id,
        "samples": [item.sample for item in items if item.sample is not None],
    }
    if first.prev_feedback is not None:
        body["prev_feedback"] = first.prev_feedback
    if items[-1].session_done:
        body["session_done"] = True
    if first.trajectory_meta is not None:
        body["trajectory_meta"] = first.trajectory_meta
    return body


def _describe(response: httpx.Response) -> str:
    """`HTTP <status> <code>: <message>` from the error envelope, or the start of a non-envelope body."""
    try:
        error = response.json()["error"]
        return f"HTTP {response.status_code} {error['code']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


def _retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "")
    try:
        seconds = float(value)
    except ValueError:
        return None  # absent, or an HTTP date: the backoff alone decides
    return seconds if seconds >= 0 else None


class TrajectoryUploader:
    """Queues rail-v1 items and uploads them in per-session batches; see the module docstring.

        agent_key = load_agent_key("support-bot.key.json")  # common/signing_keys.py
        async with TrajectoryUploader(endpoint="http://127.0.0.1:8080", sign_key=agent_key) as uploader:
            await uploader.submit("s1", {"step_index": 0, "messages": [...], "prompt_ids": [...],
                                         "response_tokens": [...], "logprobs": [...]})
            await uploader.submit("s1", prev_feedback="thanks", session_done=True)
        print(uploader.metrics)

    :param endpoint: base URL of a gateway or RL Service (or the full upload URL).
    :param sign_key: an agent key (`openjiuwen-rl keys add-agent` mints one; the operator key is refused: an agent
        never needs it); every attempt is signed anew (CONTRACT §3.2).
    :param bearer: `RL_SERVICE_TOKEN` when talking to an RL Service directly.
    :param max_queue: items accepted and not yet settled (queued or in flight).
    :param max_batch: samples per batch.
    :param flush_interval_s: how long an incomplete batch may wait for more items.
    :param max_retries: extra attempts per batch on transport errors, 429 and 5xx.
    :param timeout_s: per attempt.
    :param max_in_flight: concurrent requests (one per session at most).
    :param client: an `httpx.AsyncClient` to use (not closed by `close()`); else one is opened by `start()`.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        sign_key: SigningKey | None = None,
        bearer: str | None = None,
        max_queue: int = 1000,
        max_batch: int = 16,
        flush_interval_s: float = 1.0,
        max_retries: int = 5,
        backoff_first_s: float = 0.5,
        backoff_cap_s: float = 10.0,
        timeout_s: float = 30.0,
        max_in_flight: int = 4,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if sign_key is not None and not sign_key.is_agent:
            raise ValueError("sign_key must be an agent key: the operator key stays with the operator")
        if bearer is not None and not bearer.strip():
            raise ValueError("bearer must be None or non-blank")
        if max_queue < 1 or max_batch < 1 or max_in_flight < 1 or max_retries < 0:
            raise ValueError("max_queue, max_batch and max_in_flight must be >= 1, max_retries >= 0")
        if flush_interval_s < 0 or backoff_first_s < 0 or backoff_cap_s < backoff_first_s or timeout_s <= 0:
            raise ValueError("flush_interval_s, backoff_first_s >= 0; backoff_cap_s >= backoff_first_s; timeout_s > 0")
        self._url = upload_url(endpoint)
        self._sign_key = sign_key
        self._bearer = bearer
        self._max_batch = max_batch
        self._flush_interval_s = flush_interval_s
        self._max_retries = max_retries
        self._backoff_first_s = backoff_first_s
        self._backoff_cap_s = backoff_cap_s
        self._timeout_s = timeout_s
        self._client = client
        self._owns_client = client is None
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self._slots = _Slots(max_queue)
        self._lanes: dict[str, _Lane] = {}
        self._unsettled = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._urgent = 0  # > 0 while a flush or close waits: batches go without waiting for more items
        self._state = "new"  # new → started → closed
        self._closed = asyncio.Event()  # set once close() has finished
        self._metrics = UploaderMetrics()
        # Signed per attempt (strictly increasing timestamps): the gateway refuses a (timestamp, signature) pair it
        # has already accepted, and a quick retry of the same body could repeat one within a millisecond.
        self._auth = HmacAuth(sign_key) if sign_key is not None else httpx.USE_CLIENT_DEFAULT
        self.last_error: str | None = None

    def __repr__(self) -> str:  # never the key or the token
        auth = "hmac" if self._sign_key else "bearer" if self._bearer else "none"
        return f"TrajectoryUploader(url={self._url!r}, auth={auth}, state={self._state})"

    @property
    def metrics(self) -> UploaderMetrics:
        """A snapshot of the counters."""
        return replace(self._metrics)

    @property
    def pending(self) -> int:
        """Items submitted and not yet settled (sent, dropped, failed or discarded)."""
        return self._unsettled

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the HTTP client (unless one was given). Idempotent; refused after `close()`."""
        if self._state == "closed":
            raise UploaderClosed("the uploader is closed")
        if self._state == "new":
            if self._client is None:
                self._client = httpx.AsyncClient(timeout=self._timeout_s)
            self._state = "started"

    async def flush(self) -> None:
        """Send whatever is queued without waiting for fuller batches; return once nothing is pending.

        Items submitted meanwhile are waited for too. Each batch settles within its retry budget, so this ends."""
        self._urgent += 1
        try:
            for lane in list(self._lanes.values()):
                lane.changed.set()
            await self._idle.wait()
        finally:
            self._urgent -= 1

    async def close(self, *, flush: bool = True) -> None:
        """Stop accepting items; with `flush`, deliver what is queued first (else discard it, counted in
        `samples_lost`). Submitters waiting for room get UploaderClosed. Idempotent: a second call waits for the
        first to finish."""
        if self._state == "closed":
            await self._closed.wait()
            return
        started = self._state == "started"
        self._state = "closed"
        self._slots.close()
        try:
            if flush and started:
                await self.flush()
        finally:
            tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                if self._owns_client and self._client is not None:
                    await self._client.aclose()
            finally:
                self._closed.set()

    async def __aenter__(self) -> TrajectoryUploader:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        # Flush after success or an ordinary error in the agent; not when cancelled or interrupted.
        await self.close(flush=exc_type is None or issubclass(exc_type, Exception))

    # ------------------------------------------------------------------ submitting

    async def submit(
        self,
        session_id: str,
        sample: Mapping[str, Any] | None = None,
        *,
        trajectory_id: str | None = None,
        prev_feedback: str | None = None,
        session_done: bool = False,
        trajectory_meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Queue one item, waiting while the queue is full.

        :param sample: one rail-v1 sample (`messages`, `prompt_ids`, `response_tokens`, `logprobs`, optional
            `response`, `tools`, `response_mask`, `meta`, ...) with its `step_index`, which names it
            `<trajectory_id>:<step_index>` on the service. Copied now; the caller may reuse its lists.
        :param trajectory_id: defaults to `session_id`.
        :param prev_feedback: the user's reaction to the previous reply; the service judges the session's earliest
            staged sample with it before staging this item's sample.
        :param session_done: the session ended: the service judges every staged sample of it with "".
        :raises ValueError / TypeError: an invalid item (nothing is queued).
        :raises UploaderClosed: after `close()`, also while waiting.
        """
        item = self._item(session_id, sample, trajectory_id, prev_feedback, session_done, trajectory_meta)
        await self._slots.take()
        if self._state == "closed":  # the slot was handed over just before close()
            self._slots.give(1)
            raise UploaderClosed("the uploader is closed")
        self._enqueue(item)

    def try_submit(
        self,
        session_id: str,
        sample: Mapping[str, Any] | None = None,
        *,
        trajectory_id: str | None = None,
        prev_feedback: str | None = None,
        session_done: bool = False,
        trajectory_meta: Mapping[str, Any] | None = None,
    ) -> bool:
        """Like `submit`, but False (nothing queued) instead of waiting when the queue is full."""
        item = self._item(session_id, sample, trajectory_id, prev_feedback, session_done, trajectory_meta)
        if not self._slots.try_take():
            return False
        self._enqueue(item)
        return True

    def _item(
        self,
        session_id: str,
        sample: Mapping[str, Any] | None,
        trajectory_id: str | None,
        prev_feedback: str | None,
        session_done: bool,
        trajectory_meta: Mapping[str, Any] | None,
    ) -> _Item:
        if self._state == "new":
            raise RuntimeError("call start() (or use `async with`) before submitting")
        if self._state == "closed":
            raise UploaderClosed("the uploader is closed")
        check_id("session_id", session_id)
        check_id("trajectory_id", session_id if trajectory_id is None else trajectory_id)
        if sample is None and prev_feedback is None and not session_done:
            raise ValueError("an item needs a sample, prev_feedback or session_done")
        if prev_feedback is not None and not isinstance(prev_feedback, str):
            raise TypeError("prev_feedback must be a string")
        if not isinstance(session_done, bool):
            raise TypeError("session_done must be a boolean")
        snapshot = None
        if sample is not None:
            if not isinstance(sample, Mapping):
                raise TypeError("sample must be a mapping (one rail-v1 sample)")
            step = sample.get("step_index")
            if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP_INDEX:
                # Without it the service would number samples by batch position: re-sending would not be idempotent.
                raise ValueError(f"sample.step_index must be an integer between 0 and {MAX_STEP_INDEX}")
            snapshot = orjson.loads(orjson.dumps(dict(sample)))  # a copy; refuses what JSON cannot carry
        meta = None
        if trajectory_meta is not None:
            if not isinstance(trajectory_meta, Mapping):
                raise TypeError("trajectory_meta must be a mapping")
            meta = orjson.loads(orjson.dumps(dict(trajectory_meta)))
        return _Item(
            session_id=session_id,
            trajectory_id=session_id if trajectory_id is None else trajectory_id,
            sample=snapshot,
            prev_feedback=prev_feedback,
            session_done=session_done,
            trajectory_meta=meta,
            submitted_at=asyncio.get_running_loop().time(),
        )

    def _enqueue(self, item: _Item) -> None:
        # No await from here to the end: the lane and its sender task stay consistent (see _run_lane's finally).
        self._unsettled += 1
        self._idle.clear()
        lane = self._lanes.get(item.session_id)
        if lane is None:
            lane = self._lanes[item.session_id] = _Lane()
        lane.items.append(item)
        lane.changed.set()
        if lane.task is None:
            lane.task = asyncio.create_task(self._run_lane(item.session_id, lane),
                                            name=f"rail-upload:{item.session_id}")

    def _settle(self, count: int) -> None:
        self._unsettled -= count
        if self._unsettled == 0:
            self._idle.set()
        self._slots.give(count)

    # ------------------------------------------------------------------ sending

    async def _run_lane(self, session_id: str, lane: _Lane) -> None:
        """Send the session's batches one after another until its lane is empty."""
        try:
            while lane.items:
                await self._wait_until_due(lane)
                count, _ = _batch_extent(lane.items, self._max_batch)
                items = [lane.items.popleft() for _ in range(count)]
                try:
                    async with self._in_flight:
                        await self._deliver(items)
                except asyncio.CancelledError:
                    self._lose(items, "discarded: the uploader closed")
                    raise
                finally:
                    self._settle(len(items))
        except Exception:  # a bug here must not wedge flush(): log it and settle what the lane still holds
            log.exception("rail upload lane of session %s failed", session_id)
        finally:
            if lane.items:
                left = list(lane.items)
                lane.items.clear()
                self._lose(left, "discarded: the uploader closed")
                self._settle(len(left))
            # No await between the `while` test and here, so no item can slip in unseen: the next submit starts a
            # new lane.
            if self._lanes.get(session_id) is lane:
                del self._lanes[session_id]

    async def _wait_until_due(self, lane: _Lane) -> None:
        loop = asyncio.get_running_loop()
        due = lane.items[0].submitted_at + self._flush_interval_s
        while not self._urgent and not _batch_extent(lane.items, self._max_batch)[1]:
            remaining = due - loop.time()
            if remaining <= 0:
                return
            lane.changed.clear()
            try:
                async with asyncio.timeout(remaining):
                    await lane.changed.wait()
            except TimeoutError:
                return

    async def _deliver(self, items: list[_Item]) -> None:
        """One batch to its end: sent, dropped (4xx) or failed (retries exhausted). Never raises for HTTP."""
        assert self._client is not None
        body = _batch_body(items)
        payload = orjson.dumps(body)
        where = f"session {body['session_id']} trajectory {body['trajectory_id']} ({len(body['samples'])} samples)"
        attempt = 0
        while True:
            retry_after_s = None
            try:
                response = await self._client.post(self._url, content=payload, headers=self._headers(),
                                                   auth=self._auth, timeout=self._timeout_s)
            except httpx.TransportError as exc:  # includes timeouts; the service may or may not have seen it
                problem = type(exc).__name__ + (f": {exc}" if str(exc) else "")
            else:
                if response.is_success:
                    self._record_sent(body, response)
                    return
                problem = _describe(response)
                if not _retryable(response.status_code):
                    self._metrics.dropped += 1
                    self._lose(items, f"rail batch of {where} refused, not retried: {problem}")
                    return
                retry_after_s = _retry_after_s(response)
            if attempt >= self._max_retries:
                self._metrics.failed += 1
                self._lose(items, f"rail batch of {where} failed after {attempt + 1} attempts: {problem}")
                return
            delay_s = self._delay_s(attempt, retry_after_s)
            attempt += 1
            self._metrics.retried += 1
            log.warning("rail batch of %s: %s; retry %d of %d in %.2f s", where, problem, attempt,
                        self._max_retries, delay_s)
            await asyncio.sleep(delay_s)

    def _headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self._bearer is not None:
            headers["authorization"] = f"Bearer {self._bearer}"
        return headers

    def _delay_s(self, attempt: int, retry_after_s: float | None) -> float:
        base = min(self._backoff_first_s * 2**attempt, self._backoff_cap_s)
        delay = base * (0.5 + random.random() / 2)  # jitter: agents failing together do not retry together
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, self._backoff_cap_s))
        return delay

    def _record_sent(self, body: dict[str, Any], response: httpx.Response) -> None:
        self._metrics.sent += 1
        self._metrics.samples_sent += len(body["samples"])
        try:
            result = response.json()["result"]
            rejected, judge_failed, errors = result["rejected"], result["judge_failed"], result["errors"]
        except (ValueError, KeyError, TypeError):
            log.warning("rail batch of session %s: answer %d without a rail-v1 result", body["session_id"],
                        response.status_code)
            return
        self._metrics.rejected += rejected if isinstance(rejected, int) else 0
        self._metrics.judge_failed += judge_failed if isinstance(judge_failed, int) else 0
        for error in errors if isinstance(errors, list) else []:
            if isinstance(error, dict):
                self.last_error = f"sample {error.get('sample_id')}: {error.get('error')}"
                log.warning("rail %s", self.last_error)

    def _lose(self, items: list[_Item], problem: str) -> None:
        self._metrics.samples_lost += sum(1 for item in items if item.sample is not None)
        self.last_error = problem
        log.error("%s", problem)
