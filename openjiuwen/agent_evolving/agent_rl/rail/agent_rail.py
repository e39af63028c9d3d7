"""`RLOnlineRail`: the per-turn hook an agent loop calls to feed online RL with rail-v1 uploads (CONTRACT §4.6).

One rail per agent session. After each model call the loop reports the step (`on_step`); when the user answers,
it reports the answer (`on_user_feedback`), which travels as `prev_feedback` with the next upload so the service's
Judge scores the earlier reply with it; when the session ends, `on_session_end` asks the service to judge whatever
is still waiting with no feedback (`session_done`).

    async with TrajectoryUploader(endpoint=gateway_url, sign_key=api_key) as uploader:
        rail = RLOnlineRail(uploader, session_id="s-42", policy_version="base")
        completion = await vllm_chat(messages)               # asked with return_token_ids and logprobs
        await rail.on_step(messages, completion)             # token ids and logprobs read from the completion
        rail.on_user_feedback("that was wrong, try again")
        ...
        await rail.on_session_end()

Steps are numbered 0, 1, 2 ... per rail, so the service names them `<trajectory_id>:<step>`. rail-v1 pairs each
feedback with one step, the session's earliest step not judged yet; two answers of the user in a row are joined
into one feedback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .uploader import TrajectoryUploader, check_id


class RLOnlineRail:
    """Turns an agent loop's steps, user answers and session end into rail-v1 items on `uploader`.

    :param trajectory_id: defaults to `session_id`; sample ids are `<trajectory_id>:<step>`, so it must be unique
        across everything uploaded to the service (one trajectory per session, or a fresh id per episode).
    :param policy_version: the policy that produced the replies (`base` or `<model_id>:vN`), for off-policy lag.
    :param tools: tool definitions offered to the model, sent with every step unless a step gives its own.
    """

    def __init__(
        self,
        uploader: TrajectoryUploader,
        *,
        session_id: str,
        trajectory_id: str | None = None,
        policy_version: str | None = None,
        trajectory_meta: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self._uploader = uploader
        self.session_id = check_id("session_id", session_id)
        self.trajectory_id = check_id("trajectory_id", session_id if trajectory_id is None else trajectory_id)
        meta = dict(trajectory_meta or {})
        if policy_version is not None:
            meta["policy_version"] = policy_version
        self._meta = meta or None
        self._tools = list(tools) if tools else None
        self._next_step = 0
        self._feedback: str | None = None
        self._ended = False

    @property
    def steps(self) -> int:
        """Steps reported so far."""
        return self._next_step

    @property
    def ended(self) -> bool:
        return self._ended

    async def on_step(
        self,
        messages: Sequence[Mapping[str, Any]],
        response: Any,
        prompt_ids: Sequence[int] | None = None,
        response_tokens: Sequence[int] | None = None,
        logprobs: Sequence[float] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        response_mask: Sequence[int] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        """Queue one model call; returns its sample id. Waits while the uploader's queue is full.

        :param messages: the chat messages the model was given (copied now).
        :param response: the reply: its text, an assistant message, or a whole `chat.completion` (a dict or an
            OpenAI SDK object). From a vLLM completion asked with `return_token_ids` and `logprobs`, the token ids
            and logprobs are read when the next three arguments are left out.
        :param prompt_ids: the prompt's token ids, exactly as the model saw them.
        :param response_tokens: the generated token ids.
        :param logprobs: one behaviour logprob per generated token.
        :param response_mask: 1 for tokens the model generated, 0 for tokens inserted by the agent.
        :param meta: sample metadata (e.g. `routed_experts`).
        """
        if self._ended:
            raise RuntimeError(f"session {self.session_id} already ended")
        completion = _as_dict(response)
        if prompt_ids is None or response_tokens is None or logprobs is None:
            found = _tokens_of(completion)
            prompt_ids = found[0] if prompt_ids is None else prompt_ids
            response_tokens = found[1] if response_tokens is None else response_tokens
            logprobs = found[2] if logprobs is None else logprobs
        step = self._next_step
        sample: dict[str, Any] = {
            "step_index": step,
            "messages": [_plain(m) for m in messages],
            "prompt_ids": list(prompt_ids),
            "response_tokens": list(response_tokens),
            "logprobs": list(logprobs),
            "response": _response_part(completion),
        }
        step_tools = tools if tools is not None else self._tools
        if step_tools:
            sample["tools"] = [_plain(t) for t in step_tools]
        if response_mask is not None:
            sample["response_mask"] = list(response_mask)
        if meta:
            sample["meta"] = dict(meta)
        # Number and take the feedback before the first await: concurrent calls keep their order.
        self._next_step += 1
        feedback, self._feedback = self._feedback, None
        await self._uploader.submit(self.session_id, sample, trajectory_id=self.trajectory_id,
                                    prev_feedback=feedback, trajectory_meta=self._meta)
        return f"{self.trajectory_id}:{step}"

    def on_user_feedback(self, text: str) -> None:
        """Record the user's answer; it goes out with the next step or the session end as `prev_feedback`."""
        if not isinstance(text, str):
            raise TypeError("feedback must be a string")
        if self._ended:
            raise RuntimeError(f"session {self.session_id} already ended")
        self._feedback = text if self._feedback is None else f"{self._feedback}\n{text}"

    async def on_session_end(self) -> None:
        """Mark the session done (with any feedback not sent yet). Idempotent."""
        if self._ended:
            return
        self._ended = True
        feedback, self._feedback = self._feedback, None
        await self._uploader.submit(self.session_id, trajectory_id=self.trajectory_id, prev_feedback=feedback,
                                    session_done=True, trajectory_meta=self._meta)


def _plain(value: Any) -> dict[str, Any]:
    """A message or tool definition as a plain dict (OpenAI SDK objects are dumped without unset fields)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    return dict(value)


def _as_dict(response: Any) -> dict[str, Any]:
    if isinstance(response, str):
        return {"content": response}
    if hasattr(response, "model_dump"):  # OpenAI SDK objects (pydantic); vLLM's extra fields are kept
        response = response.model_dump()
    if not isinstance(response, Mapping):
        raise TypeError("response must be a string, a message, or a chat.completion")
    return dict(response)


def _first_choice(completion: dict[str, Any]) -> dict[str, Any] | None:
    choices = completion.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return dict(choices[0])
    return None


def _tokens_of(completion: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """Prompt ids, response ids and logprobs of a vLLM chat.completion asked with the capture flags."""
    choice = _first_choice(completion) or {}
    prompt_ids = completion.get("prompt_token_ids")
    response_ids = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(prompt_ids, list) or not isinstance(response_ids, list) or not isinstance(content, list):
        raise ValueError("pass prompt_ids, response_tokens and logprobs, or a vLLM chat.completion that carries "
                         "prompt_token_ids, choices[0].token_ids and choices[0].logprobs (ask with "
                         "return_token_ids=true and logprobs=true)")
    return prompt_ids, response_ids, [entry["logprob"] for entry in content]


def _response_part(completion: dict[str, Any]) -> dict[str, Any]:
    """The rail-v1 `response` object: `content`, `tool_calls`, `finish_reason`, `usage` (those present)."""
    choice = _first_choice(completion)
    if choice is not None:
        message = dict(choice.get("message") or {})
        finish_reason, usage = choice.get("finish_reason"), completion.get("usage")
    else:
        message = completion
        finish_reason, usage = completion.get("finish_reason"), completion.get("usage")
    part: dict[str, Any] = {"content": _text(message.get("content"))}
    if message.get("tool_calls"):
        part["tool_calls"] = list(message["tool_calls"])
    if isinstance(finish_reason, str):
        part["finish_reason"] = finish_reason
    if isinstance(usage, Mapping):
        part["usage"] = dict(usage)
    return part


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    raise TypeError("response content must be a string or a list of content parts")
