"""The inference proxy: OpenAI `/v1/chat/completions` and Anthropic `/v1/messages` over the vLLM instances, with
capture of the completions that belong to an active RL Task (CONTRACT §3.5–§3.7).

A request is captured iff its `X-Agent-Session-Id` maps to an active Task; everything else goes straight to an
instance. For a captured call: `:before` (the RL Service injects the flags) → upstream → `:after` with the complete
(or stream-aggregated) response before the client sees the end, or `:discard` on an upstream error, a broken stream
or a client disconnect. Private fields never reach a client.

A request is one call object (captured_call.py) that holds its counts: its instance's requests in flight (least-busy
routing) and, when captured, its Task's captures in flight (a Task stop drains them). It is closed when the handler
returns or, for a stream, when the relay it was handed over to ends; a capture still pending then is discarded, and
the Task's count ends when the hook that ends the capture (`:after` or `:discard`) returns.

Inside a Task the request goes upstream as sent, only the values vLLM itself would refuse answered first
(capture_fields.py), and a Task started with a capture secret needs it on every call (auth/capture_secret.py). Outside a
Task the body goes upstream as the client sent it, but may name only the base model or the active version of a line,
and a version of a lineage's line only when the caller may (auth/lineage_access.py, issue 37 item 1): else the answer of
an unknown model. A vLLM error answer reaches the client as JSON only (responses.upstream_error).

A request counts in flight on its instance from the routing pick, before any page-in, and a page-in that failed is
tried once more on another instance (`_route`, issue 37 items 3 and 4).

What an instance answers is held to `max_upstream_bytes` (issue 28 item 4): a JSON or error answer past it is read
no further and is 502 `upstream_too_large`; in a stream, one event past it, or a captured stream past it in all (the
aggregation `:after` needs), ends the stream as any broken stream ends, and the capture is discarded. A stream
outside a Task is relayed event by event and never aggregated, so only its events are bounded.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ...common import json_nesting
from ...common.lineage import DEFAULT_LINEAGE, lineage_of_version, split_line
from ...common.wire import headers as wire_headers
from ..auth import capture_secret
from ..auth.lineage_access import LineageAccess
from ..domain_errors import error_answer
from ..http11 import AnswerTooLarge, HttpError, Http11Client, StreamedAnswer
from ..instances.instances import Instance
from ..lora.lora_manager import LoraManager
from ..lora.lora_types import LoraError
from ..lora.policy_lines import line_of_version, model_of_line
from ..responses import envelope, json_response, upstream_error
from ..rl.rl_client import CaptureFailed, RLClient
from ..rl.sessions import Binding
from ..rl.tasks import TaskTracker
from .anthropic import AnthropicStreamWriter, anthropic_to_openai_request, openai_to_anthropic_response
from .capture_fields import FieldInvalid, check_request
from .capture_hooks import CaptureHooks
from .captured_call import CapturedCall, ProxiedCall
from .openai_shapes import (
    ClientWants, StreamAggregator, client_view_chunk, client_view_response, client_wants, parse_completion,
    stream_fields_refused,
)
from .sse import DONE, encode_sse, iter_sse_batches

if TYPE_CHECKING:
    from ..metrics import GatewayMetrics

log = logging.getLogger("openjiuwen.agent_rl.gateway.inference")

UPSTREAM_READ_TIMEOUT_S = 600.0  # one read; a long generation streams or answers within it
CHAT_PATH = "/v1/chat/completions"


class InferenceProxy:
    def __init__(
        self,
        *,
        model_id: str,
        tracker: TaskTracker,
        loras: LoraManager,
        rl: RLClient,
        rl_running: Callable[[], bool],
        upstream: Http11Client,
        max_upstream_bytes: int,
        metrics: "GatewayMetrics | None" = None,
        recheck: Callable[[], Awaitable[None]] | None = None,
        access: LineageAccess | None = None,
    ) -> None:
        """`recheck`: an immediate health check of every instance (instances/health.py), awaited once by a request that
        finds no healthy instance before it gets 503 `no_healthy_instances` (issue 28 item 12). `access`: who may name a
        lineage's versions outside a Task (None: nobody but for the default line)."""
        self._metrics = metrics
        self._max_upstream_bytes = max_upstream_bytes
        self._recheck = recheck
        self._model_id = model_id
        self._sessions = tracker.sessions
        self._loras = loras
        self._routing = loras.routing
        self._hooks = CaptureHooks(rl, tracker, metrics)
        self._rl_running = rl_running
        self._upstream = upstream
        self._access = access

    # ---------------------------------------------------------------- routes

    async def chat(self, request: Request) -> Response:
        body = await self._json_body(request)
        if isinstance(body, Response):
            return body
        refused = stream_fields_refused(body)
        if refused is not None:
            return envelope(400, "invalid_request", refused)
        return await self._serve(request, body, flavor="openai")

    async def messages(self, request: Request) -> Response:
        body = await self._json_body(request)
        if isinstance(body, Response):
            return body
        try:
            converted = anthropic_to_openai_request(body)
        except ValueError as exc:
            return envelope(400, "invalid_request", str(exc))
        return await self._serve(request, converted, flavor="anthropic", client_model=body.get("model"))

    @staticmethod
    async def _json_body(request: Request) -> dict[str, Any] | Response:
        try:
            body = json_nesting.loads(await request.body())
        except json_nesting.TooDeep as exc:
            return envelope(400, "invalid_request", f"request body is {exc}")
        except orjson.JSONDecodeError:
            return envelope(400, "invalid_request", "request body is not valid JSON")
        if not isinstance(body, dict):
            return envelope(400, "invalid_request", "request body must be a JSON object")
        return body

    async def _serve(
        self, request: Request, body: dict[str, Any], *, flavor: str, client_model: str | None = None,
    ) -> Response:
        wants = client_wants(body)
        if client_model is not None:
            wants = ClientWants(wants.logprobs, wants.usage, wants.stream, client_model)
        session_id = request.headers.get(wire_headers.SESSION_ID)
        binding = self._sessions.for_session(session_id)
        if binding is None or not self._rl_running():
            if self._metrics is not None:  # the lineage of the version named; base and anything else: default
                self._metrics.lineage_request(
                    lineage_of_version(body.get("model"), self._model_id) or DEFAULT_LINEAGE, captured=False)
            # The call's counts: closed here when the answer is returned, or by the stream's relay it is handed to.
            with ProxiedCall() as call:
                return await self._bypass(request, body, wants, flavor, session_id, call)
        return await self._serve_captured(request, body, wants, flavor, binding)

    async def _serve_captured(
        self, request: Request, body: dict[str, Any], wants: ClientWants, flavor: str, binding: Binding,
    ) -> Response:
        if binding.secret_digest is not None:
            presented = request.headers.get(capture_secret.HEADER)
            if presented is None:
                return envelope(403, "capture_secret_required",
                                "this session's RL Task requires its capture secret in X-Agent-Capture-Secret")
            if not capture_secret.matches(presented, binding.secret_digest):
                return envelope(403, "invalid_capture_secret", "wrong capture secret for this session's RL Task")
        if self._metrics is not None:  # ranks lineages for a label: only a request its Task's secret admits
            self._metrics.lineage_request(binding.lineage, captured=True)
        try:
            check_request(body)
        except FieldInvalid as exc:
            return envelope(400, "invalid_request", str(exc))
        # Counted among the Task's captures in flight from here until the call's capture ends (captured_call.py).
        with CapturedCall(self._sessions, self._hooks, binding, request.headers.get("x-agent-turn-id")) as call:
            return await self._captured(dict(body, model=binding.policy_model), wants, flavor, call)

    # ---------------------------------------------------------------- bypass

    async def _bypass(
        self, request: Request, body: dict[str, Any], wants: ClientWants, flavor: str, session_id: str | None,
        call: ProxiedCall,
    ) -> Response:
        model = body.get("model")
        line = line_of_version(model)
        if line is not None and model_of_line(line) == self._model_id:
            # Older versions stay loaded only for the Tasks pinned to them (a rolled-back version included): traffic
            # outside a Task gets the base model or the active version of a line, never those; and a lineage's
            # versions only when the caller may, decided first so that a refusal reads as an unknown model.
            allowed = line == self._model_id or (
                self._access is not None and await self._access.allows(request, split_line(line)[1]))
            if not allowed or model != self._loras.snapshot(line)[1]:
                return envelope(404, "model_not_found",
                                f"the model {model} is not served outside an RL Task; name {self._model_id} or "
                                "an active version you may use")
        try:
            # Base traffic of one session sticks to one instance (prefix-cache reuse); LoRA traffic never does.
            policy_model = model if isinstance(model, str) else self._model_id
            instance = await self._route(policy_model, call, task=False, affinity_key=session_id)
        except LoraError as exc:
            return error_answer(exc)
        return await self._upstream_answer(instance, body, wants, flavor, call)

    # -------------------------------------------------------------- captured

    async def _captured(self, body: dict[str, Any], wants: ClientWants, flavor: str, call: CapturedCall) -> Response:
        """`body`: checked, `model` already the pinned policy model."""
        binding = call.binding
        try:
            injected = await self._hooks.before(call, body)
        except CaptureFailed as exc:
            return error_answer(exc)
        call.captured(injected)  # from here it ends by `:after` or `:discard`
        try:
            # The pinned version itself, loaded on demand where it was paged out: never another adapter or base.
            instance = await self._route(binding.policy_model, call, task=True, affinity_key=binding.session_id,
                                         captured=True)
        except LoraError as exc:
            return error_answer(exc)
        call.instance = instance.name
        return await self._upstream_answer(instance, injected, wants, flavor, call)

    async def _route(self, policy_model: str, call: ProxiedCall, *, task: bool, **how: Any) -> Instance:
        """The instance that serves the call, its count in flight held by the call from before the page-in (so
        concurrent first loads see each other) and, on a paging instance, the version loaded there. A page-in that
        failed is tried once on another instance: the one that failed is in backoff, last in line."""
        instance = await self._pick(self._model_id, policy_model, **how)
        try:
            return await self._paged_in(instance, policy_model, call, task=task)
        except LoraError as exc:
            if exc.code != "lora_load_failed":
                raise
            again = await self._pick(self._model_id, policy_model, **how)
            if again.name == instance.name:  # no other instance can load it
                raise
            return await self._paged_in(again, policy_model, call, task=task)

    async def _paged_in(self, instance: Instance, policy_model: str, call: ProxiedCall, *, task: bool) -> Instance:
        with contextlib.ExitStack() as counts:  # released at once when the page-in fails
            counts.enter_context(self._routing.in_flight(instance))
            await self._loras.page_in(instance, policy_model, counts, task=task)
            call.enter_context(counts.pop_all())
        return instance

    async def _pick(self, model: str, policy_model: str, **how: Any) -> Instance:
        """The routing pick; when every instance is out of routing, once more after an immediate health check (a
        vLLM that came up since the last round serves at once rather than a probe interval later)."""
        try:
            return self._routing.pick(model, policy_model, **how)
        except LoraError as exc:
            if exc.code != "no_healthy_instances" or self._recheck is None:
                raise
        await self._recheck()
        return self._routing.pick(model, policy_model, **how)

    # -------------------------------------------------------------- upstream

    async def _upstream_answer(
        self, instance: Instance, body: dict[str, Any], wants: ClientWants, flavor: str, call: ProxiedCall,
    ) -> Response:
        """Send to `instance` (the call counts it in flight there since `_route`, until the answer or the stream
        ends). An error answer leaves the capture pending: the call discards it when it closes."""
        stream = body.get("stream") is True
        call.request_json = request_json = orjson.dumps(body)  # once: `:after` carries these bytes
        started = time.perf_counter()
        try:
            resp = await self._upstream.open_stream(
                "POST", instance.base_url + CHAT_PATH, content=request_json,
                headers={"content-type": "application/json"}, read_timeout_s=UPSTREAM_READ_TIMEOUT_S,
            )
        except HttpError as exc:
            if self._metrics is not None:
                self._metrics.upstream_answered(instance.name, "error", time.perf_counter() - started)
            return envelope(502, "upstream_unavailable", f"vLLM instance unreachable: {type(exc).__name__}")
        if self._metrics is not None:
            self._metrics.upstream_answered(instance.name, str(resp.status), time.perf_counter() - started)
        if resp.status != 200:
            try:
                content = await resp.aread(max_bytes=self._max_upstream_bytes)
            except AnswerTooLarge:
                return self._too_large(instance)
            except HttpError as exc:
                content = orjson.dumps({"error": {"code": "upstream_unavailable",
                                                  "message": f"vLLM answer broken: {type(exc).__name__}"}})
            finally:
                await resp.aclose()
            return upstream_error(resp.status, content, resp.headers.get("content-type"))
        if stream:
            return StreamingResponse(
                self._relay_stream(resp, wants, flavor, call.hand_over()), media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        try:
            content = await resp.aread(max_bytes=self._max_upstream_bytes)
        except AnswerTooLarge:
            return self._too_large(instance)
        except HttpError as exc:
            return envelope(502, "upstream_unavailable", f"vLLM answer broken: {type(exc).__name__}")
        finally:
            await resp.aclose()
        try:
            completion = parse_completion(content, keep_token_bytes=wants.logprobs)
            if not isinstance(completion, dict):
                raise ValueError("not an object")
        except ValueError:
            return envelope(502, "upstream_invalid", "vLLM answered with invalid JSON")
        # The client's answer is built before `:after` and the parsed completion dropped: while `:after` runs, the
        # ~20k objects of a large answer would otherwise stay alive for the collector to walk, once per session.
        # An unexpected failure there is raised only after `:after`, as when the view was built after it.
        failure: Exception | None = None
        try:
            answer = self._client_answer(completion, wants, flavor)
        except Exception as exc:  # noqa: BLE001 - re-raised below, unchanged
            failure = exc
        after = call.after_body(completion, content) if isinstance(call, CapturedCall) else None
        del completion
        if after is not None:
            await call.commit(*after)
        if failure is not None:
            raise failure
        return answer

    def _too_large(self, instance: Instance) -> Response:
        log.warning("vLLM instance %s answered more than %d bytes: read no further, refused",
                    instance.name, self._max_upstream_bytes)
        return envelope(502, "upstream_too_large",
                        f"the vLLM answer is larger than {self._max_upstream_bytes} bytes (maxUpstreamBodyBytes)")

    @staticmethod
    def _client_answer(completion: dict[str, Any], wants: ClientWants, flavor: str) -> Response:
        try:
            if flavor == "anthropic":
                try:
                    message = openai_to_anthropic_response(completion, client_model=wants.model)
                except ValueError as exc:
                    return envelope(502, "upstream_invalid", f"vLLM answer cannot be converted: {exc}")
                return json_response(message)
            return json_response(
                client_view_response(completion, wants_logprobs=wants.logprobs, client_model=wants.model)
            )
        except orjson.JSONEncodeError:  # nested deeper than orjson writes; not walked on read, to keep reads cheap
            return envelope(502, "upstream_invalid", "vLLM answer is nested too deep to be relayed")

    async def _relay_stream(
        self, resp: StreamedAnswer, wants: ClientWants, flavor: str, call: ProxiedCall,
    ) -> AsyncIterator[bytes]:
        """The client's stream. It took the `call` over: closed when it ends, a broken stream or a client disconnect
        included. Only a captured stream is aggregated (for `:after`), and bounded in all."""
        captured = call if isinstance(call, CapturedCall) else None
        # One aggregation per choice of the request (`n`: validated, absent, null or a positive integer).
        aggregator = None if captured is None else StreamAggregator((captured.request or {}).get("n") or 1)
        chunks = resp.aiter_raw() if aggregator is None else resp.aiter_bounded(self._max_upstream_bytes)
        writer = AnthropicStreamWriter() if flavor == "anthropic" else None
        finish_reason: str | None = None
        usage: dict[str, Any] | None = None
        failed = False  # vLLM reported an error inside the stream: nothing valid to commit, no end marker
        started = False
        done = False
        # The events of one upstream read leave in one write: a per-event write costs more than the event itself.
        out: list[bytes] = []
        try:
            async for events in iter_sse_batches(chunks, max_event_bytes=self._max_upstream_bytes):
                for event in events:
                    if event.data == DONE:
                        done = True
                        if failed:
                            break
                        if captured is not None and aggregator is not None:
                            await captured.commit(*captured.after_body(aggregator.result()))
                        if writer is not None:
                            for name, data in writer.finish(finish_reason, usage):
                                out.append(encode_sse(orjson.dumps(data), event=name))
                        else:
                            out.append(encode_sse(DONE))
                        break
                    chunk = json_nesting.loads(event.data)  # bounded: the chunk is written again
                    if not isinstance(chunk, dict):
                        raise ValueError("stream chunk is not a JSON object")
                    failed = failed or chunk.get("error") is not None
                    if aggregator is not None:
                        aggregator.feed(chunk)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        if choice.get("finish_reason"):
                            finish_reason = choice["finish_reason"]
                    if writer is not None:
                        if not started:
                            started = True
                            prompt_ids = chunk.get("prompt_token_ids")
                            for name, data in writer.start(
                                f"msg_{chunk.get('id', '')}", wants.model or chunk.get("model") or "",
                                input_tokens=len(prompt_ids) if isinstance(prompt_ids, list) else 0,
                            ):
                                out.append(encode_sse(orjson.dumps(data), event=name))
                        for name, data in writer.feed(chunk):
                            out.append(encode_sse(orjson.dumps(data), event=name))
                        continue
                    view = client_view_chunk(chunk, wants_logprobs=wants.logprobs, wants_usage=wants.usage,
                                             client_model=wants.model)
                    if view is not None:
                        out.append(encode_sse(orjson.dumps(view)))
                if out:
                    batch, out = b"".join(out), []
                    yield batch
                if done:
                    break
        except (HttpError, ValueError, RuntimeError) as exc:  # JSONDecodeError is a ValueError
            log.warning("upstream stream broke: %s: %s", type(exc).__name__, exc)
            if out:  # what was relayable before the break still reaches the client, as before batching
                yield b"".join(out)
        finally:
            call.close()  # before any await: this generator may be inside a cancelled scope
            await resp.aclose()

    async def close(self) -> None:
        await self._hooks.close()
