"""A fixed-latency fake vLLM for the benches: pre-rendered vLLM 0.32 shapes (tests/fixtures/vllm-0.32-cpu), answered from bytes.

    python bench/upstream.py --port P [--latency-ms 200] [--prompt-tokens 256] [--completion-tokens 256]

Runs as its own process (uvloop, httptools) so the upstream costs the gateway nothing but its latency. Every
`POST /v1/chat/completions` is answered after `--latency-ms` with one of four bodies rendered once at start-up: JSON
or SSE (`"stream":true`), full (the request carries the injected `"return_token_ids":true`: prompt and completion
token ids, logprobs with as many top logprobs as `top_logprobs` asks, 0 or 1, usage chunk) or plain (what vLLM sends
without those flags: nulls). The
`model` of every answer is `--model`. `GET /health` answers 200. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
from typing import Any

import orjson

_STREAM = re.compile(rb'"stream"\s*:\s*true')
_TOKEN_IDS = re.compile(rb'"return_token_ids"\s*:\s*true')  # the flag capture gateways inject (any JSON spacing)
_TOP_ONE = re.compile(rb'"top_logprobs"\s*:\s*[1-9]')  # one alternative per token asked for (else none)
WORDS = ["alpha", "beta", "gamma", "delta", "tool", "call", "result", "plan", "step", "answer"]


def _logprob_entry(piece: str, lp: float, top: int) -> dict[str, Any]:
    entry = {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
    return dict(entry, top_logprobs=[dict(entry)][:top])


def render(model: str, prompt_tokens: int, completion_tokens: int, seed: int = 7) -> dict[str, bytes]:
    """The answer bodies: json_full, json_full1 (one top logprob per token), json_plain, and the same for sse."""
    rng = random.Random(seed)
    prompt_ids = [rng.randrange(3, 151_000) for _ in range(prompt_tokens)]
    ids = [rng.randrange(3, 151_000) for _ in range(completion_tokens)]
    pieces = [rng.choice(WORDS) + " " for _ in range(completion_tokens)]
    lps = [-round(rng.random() * 8, 6) for _ in range(completion_tokens)]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
             "completion_tokens": completion_tokens}
    head = {"id": "chatcmpl-bench0000000000", "created": 1795951800, "model": model}

    def completion(full: bool, top: int = 0) -> bytes:
        message = {"role": "assistant", "content": "".join(pieces), "refusal": None, "annotations": None,
                   "audio": None, "function_call": None, "reasoning": None}
        choice = {"index": 0, "message": message,
                  "logprobs": {"content": [_logprob_entry(p, lp, top) for p, lp in zip(pieces, lps)]} if full else None,
                  "finish_reason": "length", "stop_reason": None, "token_ids": ids if full else None,
                  "routed_experts": None}
        return orjson.dumps({**head, "object": "chat.completion", "choices": [choice], "service_tier": None,
                             "system_fingerprint": "vllm-0.32.0-bench", "usage": usage, "prompt_logprobs": None,
                             "prompt_token_ids": prompt_ids if full else None, "prompt_text": None,
                             "kv_transfer_params": None})

    def stream(full: bool, top: int = 0) -> bytes:
        chunk = {**head, "object": "chat.completion.chunk"}
        events = [dict(chunk, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None}],
                       prompt_token_ids=prompt_ids if full else None, prompt_text=None)]
        for n, (piece, lp, tid) in enumerate(zip(pieces, lps, ids)):
            last = n == completion_tokens - 1
            choice: dict[str, Any] = {"index": 0, "delta": {"content": piece},
                                      "logprobs": {"content": [_logprob_entry(piece, lp, top)]} if full else None,
                                      "finish_reason": "length" if last else None}
            if last:
                choice["stop_reason"] = None
            choice["token_ids"] = [tid] if full else None
            events.append(dict(chunk, choices=[choice]))
        if full:
            events.append(dict(chunk, choices=[], usage=usage, system_fingerprint="vllm-0.32.0-bench"))
        return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"

    return {"json_full": completion(True), "json_full1": completion(True, 1), "json_plain": completion(False),
            "sse_full": stream(True), "sse_full1": stream(True, 1), "sse_plain": stream(False)}


def _http(status: bytes, body: bytes, content_type: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Conn(asyncio.Protocol):
    def __init__(self, answers: dict[str, bytes], latency_s: float) -> None:
        import httptools

        self._answers = answers
        self._latency_s = latency_s
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self._body)
        self._body = []
        if self._url.startswith(b"/health"):
            answer = _http(b"200 OK", b"", b"text/plain")
        else:
            stream = _STREAM.search(body) is not None
            full = _TOKEN_IDS.search(body) is not None
            key = ("sse_" if stream else "json_") + ("full" if full else "plain")
            if full and _TOP_ONE.search(body) is not None:
                key += "1"
            answer = self._answers[key]
        loop = asyncio.get_running_loop()
        loop.call_later(self._latency_s, self._send, answer)

    def _send(self, answer: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(answer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None


async def serve(port: int, model: str, prompt_tokens: int, completion_tokens: int, latency_s: float) -> None:
    bodies = render(model, prompt_tokens, completion_tokens)
    answers = {k: _http(b"200 OK", v, b"text/event-stream" if k.startswith("sse") else b"application/json")
               for k, v in bodies.items()}
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(answers, latency_s), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=256)
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.port, args.model, args.prompt_tokens, args.completion_tokens, args.latency_ms / 1000))


if __name__ == "__main__":
    main()
