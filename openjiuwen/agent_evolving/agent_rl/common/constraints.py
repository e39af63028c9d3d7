"""What shaped a captured sample beyond its temperature (issue 35): the `sampling.constraints` record of a sample,
and the training policy's vocabulary.

Inside a Task every request vLLM serves is served unchanged; the RL Service records, per sample, each request field
that constrains, biases or reshapes what was sampled, as one entry per *kind* with the values that matter, bounded in
size (a schema's digest and length, never the schema). A kind is one of `KINDS` (a bounded set: it is also a metric
label). The trainers then train the sample off-policy against its captured processed logprobs, or the policy keeps it
out of training (`POLICY_DEFAULTS`, the `constrained_samples` setting; docs/training.md, docs/gateway.md "Request
fields inside a Task").

    {"json_schema": {"source": "response_format", "name": "Answer", "digest": "3f1c…", "bytes": 212, "strict": true},
     "penalties": {"presence_penalty": 0.5}, "greedy": {}}
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from .sampling import DEFAULTS, PENALTIES

# Grammar-constrained decoding: the tokens the grammar forbids are masked before sampling (vLLM's structured outputs,
# and its structural tags for forced and strict tool calls).
GRAMMAR_KINDS = (
    "json_schema", "json_object", "regex", "choice", "grammar", "structural_tag",
    "tool_required", "tool_named", "strict_tools", "single_tool_call",
)
KINDS = (
    *GRAMMAR_KINDS,
    "greedy", "penalties", "logit_bias", "allowed_tokens", "banned_tokens", "min_tokens", "ignore_eos",
    "thinking_budget", "logits_processors", "watermarking",
    "echo", "continue_final_message", "no_generation_prompt", "chat_template", "beam_search",
)

CORRECT = "correct"
EXCLUDE = "exclude"
# The training policy of each kind (`constrained_samples` keys; every grammar kind shares `grammar`) and its default,
# with the reason in docs/training.md "Constrained samples".
POLICY_DEFAULTS: dict[str, str] = {
    "grammar": CORRECT, "greedy": EXCLUDE, "penalties": CORRECT, "logit_bias": CORRECT, "allowed_tokens": CORRECT,
    "banned_tokens": CORRECT, "min_tokens": CORRECT, "ignore_eos": CORRECT, "thinking_budget": CORRECT,
    "logits_processors": EXCLUDE, "watermarking": EXCLUDE, "echo": EXCLUDE, "continue_final_message": EXCLUDE,
    "no_generation_prompt": EXCLUDE, "chat_template": EXCLUDE, "beam_search": EXCLUDE,
}
# Kinds whose tokens were not drawn from any distribution the capture records: never trained, whatever the setting.
UNTRAINABLE = frozenset({"beam_search"})
MAX_NAME_CHARS = 64

_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "guided_json_object": "json_object"}
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "json_object": "json_object", "structural_tag": "structural_tag"}


def policy_key(kind: str) -> str:
    """The `constrained_samples` key that decides `kind`."""
    return "grammar" if kind in GRAMMAR_KINDS else kind


def _digest(value: Any) -> dict[str, Any]:
    """A bounded stand-in for a schema, regex or grammar: its SHA-256 (16 hex digits) and its size in bytes."""
    raw = value.encode() if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    return {"digest": hashlib.sha256(raw).hexdigest()[:16], "bytes": len(raw)}


def _name(value: Any) -> str | None:
    return value[:MAX_NAME_CHARS] if isinstance(value, str) else None


def _grammar(out: dict[str, dict[str, Any]], kind: str, source: str, value: Any) -> None:
    entry: dict[str, Any] = {"source": source}
    if kind == "choice":
        entry["count"] = len(value) if isinstance(value, list) else 0
    elif kind != "json_object":
        entry.update(_digest(value))
    out.setdefault(kind, entry)  # the first source that names a kind is the one recorded


def _response_format(out: dict[str, dict[str, Any]], value: Any) -> None:
    if not isinstance(value, dict):
        return
    kind = value.get("type")
    if kind == "json_schema":
        spec = value.get("json_schema") if isinstance(value.get("json_schema"), dict) else {}
        entry: dict[str, Any] = {"source": "response_format"}
        name = _name(spec.get("name"))
        if name is not None:
            entry["name"] = name
        entry.update(_digest(spec.get("schema")))
        if isinstance(spec.get("strict"), bool):
            entry["strict"] = spec["strict"]
        out["json_schema"] = entry
    elif kind == "json_object":
        out["json_object"] = {"source": "response_format"}
    elif kind == "structural_tag":
        _grammar(out, "structural_tag", "response_format", value)


def _tools(out: dict[str, dict[str, Any]], request: Mapping[str, Any]) -> None:
    tools = request.get("tools")
    if not isinstance(tools, list) or not tools:
        return
    choice = request.get("tool_choice")
    if choice == "none":
        return  # no tool call can be made: nothing constrains it
    if choice == "required":
        out["tool_required"] = {"tools": len(tools)}
    elif isinstance(choice, dict):
        function = choice.get("function") if isinstance(choice.get("function"), dict) else {}
        out["tool_named"] = {"name": _name(function.get("name")) or ""}
    strict = sum(1 for tool in tools if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
                 and tool["function"].get("strict") is True)
    if strict:
        out["strict_tools"] = {"count": strict}
    if request.get("parallel_tool_calls") is False:
        out["single_tool_call"] = {}


def _sampling(out: dict[str, dict[str, Any]], request: Mapping[str, Any]) -> None:
    temperature = request.get("temperature")
    if type(temperature) in (int, float) and temperature == 0:
        out["greedy"] = {}
    penalties = {name: request[name] for name in PENALTIES
                 if type(request.get(name)) in (int, float) and request[name] != DEFAULTS[name]}
    if penalties:
        out["penalties"] = penalties
    bias = request.get("logit_bias")
    if isinstance(bias, dict) and bias:
        values = [v for v in bias.values() if type(v) in (int, float)]
        out["logit_bias"] = {"count": len(bias), **({"min": min(values), "max": max(values)} if values else {})}
    allowed = request.get("allowed_token_ids")
    if isinstance(allowed, list) and allowed:
        out["allowed_tokens"] = {"count": len(allowed)}
    banned = request.get("bad_words")
    if isinstance(banned, list) and banned:
        out["banned_tokens"] = {"count": len(banned)}
    minimum = request.get("min_tokens")
    if type(minimum) is int and minimum > 0:
        out["min_tokens"] = {"value": minimum}
    if request.get("ignore_eos") is True:
        out["ignore_eos"] = {}
    budget = request.get("thinking_token_budget")
    if budget is not None:
        out["thinking_budget"] = {"value": budget if type(budget) is int else None}
    processors = request.get("logits_processors")
    xargs = request.get("vllm_xargs")
    count = (len(processors) if isinstance(processors, list) else 0) + (len(xargs) if isinstance(xargs, dict) else 0)
    if count:
        out["logits_processors"] = {"count": count}
    if request.get("watermarking") is True:
        out["watermarking"] = {}


def _prompt_and_search(out: dict[str, dict[str, Any]], request: Mapping[str, Any]) -> None:
    if request.get("echo") is True:
        out["echo"] = {}
    if request.get("continue_final_message") is True:
        out["continue_final_message"] = {}
    if request.get("add_generation_prompt") is False:
        out["no_generation_prompt"] = {}
    kwargs = request.get("chat_template_kwargs")
    template = request.get("chat_template")
    if template is None and isinstance(kwargs, dict):
        template = kwargs.get("chat_template")
    if isinstance(template, str):
        out["chat_template"] = _digest(template)
    best_of = request.get("best_of")
    if request.get("use_beam_search") is True:
        out["beam_search"] = {"beam_width": request.get("n") if type(request.get("n")) is int else 1}
    elif type(best_of) is int and best_of > 1:
        out["beam_search"] = {"best_of": best_of}


def of_request(request: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The constraints of a captured request (as injected), kind → its bounded details, in `KINDS` order; {} for a
    request that only samples at its temperature and truncation."""
    found: dict[str, dict[str, Any]] = {}
    _response_format(found, request.get("response_format"))
    structured = request.get("structured_outputs")
    if isinstance(structured, dict):
        for key, kind in _STRUCTURED.items():
            value = structured.get(key)
            if value is not None and value is not False:
                _grammar(found, kind, "structured_outputs", value)
    for key, kind in _GUIDED.items():  # older vLLM versions apply them; 0.32 ignores them
        value = request.get(key)
        if value is not None and value is not False:
            _grammar(found, kind, key, value)
    _tools(found, request)
    _sampling(found, request)
    _prompt_and_search(found, request)
    return {kind: found[kind] for kind in KINDS if kind in found}


def kinds_of(record: Any) -> tuple[str, ...]:
    """The constraint kinds of a sample's `sampling` record (none for a record without `constraints`: a sample
    stored before issue 35, or a rail upload), unknown names left out."""
    constraints = record.get("constraints") if isinstance(record, Mapping) else None
    if not isinstance(constraints, Mapping):
        return ()
    return tuple(kind for kind in KINDS if kind in constraints)


def excluded_kinds(kinds: tuple[str, ...], policy: Mapping[str, str]) -> tuple[str, ...]:
    """The kinds among `kinds` that `policy` (the `constrained_samples` setting, `policy_key` → correct | exclude)
    keeps out of training."""
    return tuple(kind for kind in kinds
                 if kind in UNTRAINABLE or policy.get(policy_key(kind), POLICY_DEFAULTS[policy_key(kind)]) == EXCLUDE)
