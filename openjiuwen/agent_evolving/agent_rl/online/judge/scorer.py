"""JudgeScorer: the Judge over an OpenAI-compatible chat endpoint, with votes, retries and a length retry (§6)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from openjiuwen.agent_evolving.agent_rl.online.errors import JudgeFailed
from openjiuwen.agent_evolving.agent_rl.online.judge.parsing import parse_verdict
from openjiuwen.agent_evolving.agent_rl.online.judge.prompt import content_text, render_prompt
from openjiuwen.agent_evolving.agent_rl.online.judge.result import FAILED_VOTE, PROMPT_VERSION, JudgeResult

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
TEMPERATURE = 0.1
MAX_TOKENS = 4096
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
BACKOFF_STEP_S = 0.2  # the pause before retry n is n × this


def normalize_endpoint(endpoint: str) -> str:
    """The chat-completions URL for a configured endpoint: a base URL, a `/v1` URL or the full path."""
    base = endpoint.strip().rstrip("/")
    if base.endswith(CHAT_PATH):
        return base
    if base.endswith("/v1"):
        return base + "/chat/completions"
    return base + CHAT_PATH


class VoteFailed(Exception):
    """One vote produced no verdict; the reason is logged and the vote counts as "fail"."""


@dataclass(frozen=True)
class _Answer:
    content: str
    finish_reason: Any


class JudgeScorer:
    """Scores a reply with `votes` concurrent requests to an OpenAI-compatible judge model.

    Owns its `httpx.AsyncClient` unless one is passed in; `aclose()` closes only an owned client.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        model: str,
        api_key: str,
        votes: int = 1,
        min_votes: int | None = None,
        retries: int = 2,
        timeout_s: float = 30.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if not endpoint or not endpoint.strip():
            raise ValueError("judge endpoint must not be empty")
        if not model or not model.strip():
            raise ValueError("judge model must not be empty")
        if votes < 1:
            raise ValueError("judge votes must be >= 1")
        min_votes = votes // 2 + 1 if min_votes is None else min_votes
        if not 1 <= min_votes <= votes:
            raise ValueError("judge min_votes must be between 1 and votes")
        if retries < 0:
            raise ValueError("judge retries must be >= 0")
        if not timeout_s > 0:
            raise ValueError("judge timeout_s must be > 0")
        self.url = normalize_endpoint(endpoint)
        self.model = model
        self.votes = votes
        self.min_votes = min_votes
        self._retries = retries
        self._timeout_s = timeout_s
        # The key lives only in this header dict: never in attributes that a repr, log or error could show.
        key = api_key.strip() if api_key and api_key.strip() else "EMPTY"
        if not key.isascii() or not key.isprintable():
            raise ValueError("judge api key must be printable ASCII")  # an HTTP header could not carry it
        self._headers = {"Authorization": f"Bearer {key}"}
        self._owns_client = client is None
        # trust_env=False: configuration is parsed at the edge, so no proxy settings are picked up from the
        # environment behind the config's back; a caller who needs a proxy passes its own client.
        self._client = client if client is not None else httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    async def score(self, request: dict, response: dict, feedback: str) -> JudgeResult:
        """Judge `response` to `request` given the user's `feedback`; raises `JudgeFailed` below `min_votes`."""
        prompt = render_prompt(request, response, feedback)
        outcomes = await asyncio.gather(*(self._vote(prompt, n) for n in range(1, self.votes + 1)))
        overalls = [o for o in outcomes if o is not None]
        if len(overalls) < self.min_votes:
            raise JudgeFailed(
                f"only {len(overalls)} of {self.votes} judge votes succeeded ({self.min_votes} required)"
            )
        score = min(max(sum(overalls) / len(overalls) / 10.0, 0.0), 1.0)
        votes: list[float | str] = [FAILED_VOTE if o is None else o for o in outcomes]
        return JudgeResult(score=score, votes=votes, judge_model=self.model, prompt_version=PROMPT_VERSION)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _vote(self, prompt: str, n: int) -> float | None:
        """One vote's `overall`, or None (logged) when it failed."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": TEMPERATURE,
            "max_tokens": MAX_TOKENS,
            "stream": False,
        }
        try:
            answer = await self._complete(body)
            verdict = parse_verdict(answer.content)
            if verdict is None and answer.finish_reason == "length":
                # The verdict was cut off: once more, deterministic and with room to finish.
                answer = await self._complete({**body, "temperature": 0, "max_tokens": MAX_TOKENS * 2})
                verdict = parse_verdict(answer.content)
            if verdict is None:
                raise VoteFailed(f"unparsable verdict (finish_reason={answer.finish_reason!r})")
        except VoteFailed as exc:
            log.warning("judge vote %d/%d failed (model %s): %s", n, self.votes, self.model, exc)
            return None
        return verdict

    async def _complete(self, body: dict[str, Any]) -> _Answer:
        """One chat completion, retrying transport errors, timeouts and 429/5xx up to `retries` times."""
        last_error = ""
        for attempt in range(self._retries + 1):
            if attempt:
                log.info("judge request retry %d/%d after %s", attempt, self._retries, last_error)
                await asyncio.sleep(BACKOFF_STEP_S * attempt)
            try:
                # asyncio.timeout bounds the whole request; httpx's own timeout only bounds each phase.
                async with asyncio.timeout(self._timeout_s):
                    reply = await self._client.post(
                        self.url, content=orjson.dumps(body), timeout=self._timeout_s,
                        headers={**self._headers, "Content-Type": "application/json"},
                    )
            except (httpx.TransportError, TimeoutError) as exc:  # TransportError includes httpx timeouts
                last_error = type(exc).__name__
                continue
            except httpx.HTTPError as exc:  # e.g. a body that cannot be decoded: not transient
                raise VoteFailed(f"request failed: {type(exc).__name__}") from None
            if reply.status_code in RETRY_STATUSES:
                last_error = f"HTTP {reply.status_code}"
                continue
            if not reply.is_success:
                raise VoteFailed(f"HTTP {reply.status_code}")
            return _read_answer(reply.content)
        raise VoteFailed(f"no answer after {self._retries + 1} attempts; last: {last_error}")


def _read_answer(raw: bytes) -> _Answer:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise VoteFailed("response body is not JSON") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise VoteFailed("response has no choices")
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    # Some servers answer with content parts; reading them as text costs nothing and saves a vote.
    text = content if isinstance(content, str) else content_text(content) if isinstance(content, list) else ""
    return _Answer(content=text, finish_reason=choices[0].get("finish_reason"))
