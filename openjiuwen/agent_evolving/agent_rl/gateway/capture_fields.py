"""Which request fields a captured completion may carry (issue 19 item 6; the table is in docs/gateway.md).

A captured sample is (prompt token ids, response token ids, their logprobs) plus the request as sent and its
sampling. PPO treats the response as drawn from the policy at the sample's own sampling, which the trainers reproduce
(temperature per row; truncation measured and corrected: common/sampling.py). So inside a Task each client field
gets one rule:

- **honoured**: a sampling field (`temperature`, `top_p`, `top_k`, `min_p`) reaches vLLM as the client sent it; the
  RL Service then gives every sampling field the client left out an explicit neutral value and records them all;
  a value the trainers cannot reproduce (greedy decoding, a penalty) is refused, one vLLM would refuse is invalid
  (400 `invalid_request`);
- **passed**: it changes only the prompt (recorded exactly as `prompt_token_ids`), where generation stops, how
  tokens are detokenized or reported, or scheduling;
- **refused** (400 `capture_field_refused`, nothing captured, the Task stays active): it biases, bans, forces or
  grammar-constrains tokens, or changes what a sample is, unless it holds its neutral value;
- **dropped**: anything else — fields the client cannot use inside a Task, and fields no table here names (vLLM
  0.32 ignores unknown fields; a later vLLM might give one a meaning nobody has judged).

Dropped fields the client sent are named in the `X-AIGW-RL-Ignored-Fields` answer header. Bypass traffic (no Task)
is never screened.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ..common import sampling
from ..common.sampling import SamplingRefused

IGNORED_FIELDS_HEADER = "x-aigw-rl-ignored-fields"
MAX_LISTED = 32  # a body with thousands of unknown keys must not make a header that large
MAX_NAME_CHARS = 64

PASSED = frozenset({
    "model", "messages", "stream", "stream_options", "logprobs", "top_logprobs", "return_token_ids", "n",
    # where generation stops
    "max_tokens", "max_completion_tokens", "stop", "stop_token_ids", "include_stop_str_in_output",
    "repetition_detection",
    # the prompt (rendered by the server's own template; the ids are recorded)
    "tools", "documents", "chat_template_kwargs", "reasoning_effort", "add_special_tokens", "mm_processor_kwargs",
    "media_io_kwargs", "mm_payload", "truncate_prompt_tokens", "truncation_side",
    # reporting, detokenization, scheduling
    "seed", "user", "skip_special_tokens", "spaces_between_special_tokens", "include_reasoning",
    "return_tokens_as_token_ids", "return_token_offsets", "return_prompt_text", "return_mm_kwargs", "stream_interval",
    "priority", "request_id", "cache_salt", "session_id",
})


def _absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _false(value: Any) -> bool:
    return value is None or value is False


def _true(value: Any) -> bool:
    return value is None or value is True


def _number(neutral: float) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return value is None or (type(value) in (int, float) and value == neutral)
    return check


def _text_format(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") == "text" and len(value) == 1)


def _free_tool_choice(value: Any) -> bool:
    return value is None or value in ("auto", "none")


def _no_template(value: Any) -> bool:
    return not isinstance(value, dict) or "chat_template" not in value


# field → (neutral-value check, why a non-neutral value is refused)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (_empty, "it biases token probabilities"),
    "allowed_token_ids": (_absent, "it restricts which tokens can be sampled"),
    "bad_words": (_empty, "it bans tokens from being sampled"),
    "min_tokens": (_number(0), "it suppresses the end-of-sequence token"),
    "ignore_eos": (_false, "it suppresses the end-of-sequence token"),
    "response_format": (_text_format, "structured output constrains sampling with a grammar"),
    "structured_outputs": (_absent, "structured output constrains sampling with a grammar"),
    "tool_choice": (_free_tool_choice, "a required or named tool is enforced with a grammar (use auto or none)"),
    "parallel_tool_calls": (_true, "false is enforced with a grammar"),
    "thinking_token_budget": (_absent, "it forces the end of the reasoning"),
    "watermarking": (_false, "it reweights token probabilities"),
    "logits_processors": (_empty, "it changes token probabilities"),
    "vllm_xargs": (_empty, "it configures server-side logits processors"),
    "logprob_token_ids": (_empty, "the sampled tokens' logprobs would be missing"),
    "chat_template": (_absent, "a client template renders a prompt the recorded messages do not show"),
    "echo": (_false, "the answer would repeat the prompt as if the policy had generated it"),
    "add_generation_prompt": (_true, "without it the completion is not an assistant turn"),
    "continue_final_message": (_false, "the completion would continue text the client wrote"),
    "use_beam_search": (_false, "beam search is not sampling from the policy"),
    "best_of": (_number(1), "it picks one of several samples"),
    "length_penalty": (_number(1.0), "it only applies to beam search"),
}
# Older vLLM versions constrain decoding with these (0.32 ignores them); any `guided_*` field is refused.
GUIDED_PREFIX = "guided_"
GUIDED_REASON = "guided decoding constrains sampling with a grammar"


class FieldRefused(ValueError):
    """A field the capture cannot carry; `invalid` when vLLM itself would refuse its value (400 `invalid_request`),
    else 400 `capture_field_refused`."""

    def __init__(self, field: str, reason: str, *, invalid: bool = False) -> None:
        super().__init__(f"{field} must be {reason}" if invalid
                         else f"{field} is not allowed in a captured request: {reason}")
        self.field = field
        self.invalid = invalid


@dataclass(frozen=True, slots=True)
class Screened:
    request: dict[str, Any]
    ignored: tuple[str, ...]  # client fields dropped, in request order


def screen(request: dict[str, Any], *, names: dict[str, str] | None = None) -> Screened:
    """The request a Task may capture, or FieldRefused naming the first refused field (`names` maps a field to the
    name the client used, e.g. for a converted Anthropic request)."""
    names = names or {}
    out: dict[str, Any] = {}
    ignored: list[str] = []
    for key, value in request.items():
        if key in REFUSED:
            neutral, why = REFUSED[key]
            if not neutral(value):
                raise FieldRefused(names.get(key, key), why)
            out[key] = value
        elif key.startswith(GUIDED_PREFIX):
            if value is not None:
                raise FieldRefused(names.get(key, key), GUIDED_REASON)
        elif key in sampling.DEFAULTS:
            try:
                sampling.check_field(key, value)
            except SamplingRefused as exc:
                raise FieldRefused(names.get(key, key), exc.reason, invalid=exc.invalid) from None
            out[key] = value
        elif key == "chat_template_kwargs" and not _no_template(value):
            raise FieldRefused("chat_template_kwargs.chat_template", REFUSED["chat_template"][1])
        elif key == "tools":
            out[key], strict = _without_strict(value)
            ignored.extend(strict)
        elif key in PASSED:
            out[key] = value
        else:
            ignored.append(names.get(key, key))
    return Screened(out, tuple(ignored))


def ignored_header(ignored: Sequence[str]) -> str:
    """The `X-AIGW-RL-Ignored-Fields` value: names percent-encoded (a client's key may hold any character, a header
    value may not) and cut to `MAX_NAME_CHARS`, at most `MAX_LISTED` of them, then `+N more`."""
    listed = [quote(name[:MAX_NAME_CHARS], safe="_.[]-") or '""' for name in ignored[:MAX_LISTED]]
    if len(ignored) > MAX_LISTED:
        listed.append(f"+{len(ignored) - MAX_LISTED} more")
    return ", ".join(listed)


def _without_strict(tools: Any) -> tuple[Any, list[str]]:
    """`tools` without `function.strict: true` (vLLM enforces a strict tool's arguments with a grammar); SDKs such
    as the OpenAI Agents SDK set it by default, so it is dropped rather than refused."""
    if not isinstance(tools, list):
        return tools, []  # vLLM judges the shape
    out, dropped = [], []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("strict") is not None:
            if function["strict"] is not False:
                dropped.append(f"tools[{i}].function.strict")
            tool = {**tool, "function": {k: v for k, v in function.items() if k != "strict"}}
        out.append(tool)
    return out, dropped
