"""The packed `:after` body: a capture's token ids and logprobs as binary arrays instead of JSON (CONTRACT §2.8).

Between this project's gateway and its RL Service only; an AIGW keeps sending the JSON body, which the service
accepts unchanged. The service advertises the encoding in `GET /health` (`hook_encodings`); the gateway uses it
only when its child says so, and falls back to JSON for an upstream answer it cannot pack (the service then
refuses that answer with its usual, precise error).

```
"RLH1"  u32 json_length  u32 prompt_count  u32 response_count        (16-byte header, little-endian)
json_length bytes   the JSON hook body; its `response` lacks `prompt_token_ids`, `choices[0].token_ids` and
                    `choices[0].logprobs` (the stored sample never keeps those three as JSON)
prompt_count  x u32  prompt token ids
response_count x u32 completion token ids
response_count x f64 the completion's logprobs, aligned with its token ids
```

The arrays arrive in the layout the store keeps token ids in (uint32 LE): they are checked and stored without a
per-token Python object. Logprobs travel as float64, so the service checks exactly the values the JSON path would.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

import orjson

from . import json_nesting

MEDIA_TYPE = "application/vnd.openjiuwen.hook-packed"
ENCODING = "packed-v1"  # the name `GET /health` lists in `hook_encodings`
_MAGIC = b"RLH1"
_HEADER = struct.Struct("<4sIII")
_LITTLE = sys.byteorder == "little"
_STRIPPED = ("token_ids", "logprobs")


class PackedBodyError(ValueError):
    """The packed body is malformed (framing, lengths, the JSON part); the message says where."""


@dataclass(frozen=True, slots=True)
class PackedArrays:
    prompt_ids: bytes  # uint32 LE
    response_ids: bytes  # uint32 LE
    logprobs: array  # float64, aligned with response_ids

    @property
    def prompt_count(self) -> int:
        return len(self.prompt_ids) // 4

    @property
    def response_count(self) -> int:
        return len(self.response_ids) // 4


def _u32(values: Any) -> bytes:
    arr = array("I", values)  # OverflowError / TypeError for anything that is not a uint32
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def pack_after(head_json: bytes, response: dict[str, Any]) -> bytes | None:
    """The packed body of a hook head (the JSON object `rl_task_id`, `capture_id`, `agent_turn_id`, `request`, as
    bytes) and its complete OpenAI `response`; None when the response does not have the shape the packed form
    carries (non-integer ids, non-numeric logprobs, several choices ...): the caller sends JSON, and the service
    names the problem."""
    try:
        choices = response["choices"]
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        ids, content = choice["token_ids"], choice["logprobs"]["content"]
        prompt = response["prompt_token_ids"]
        if not (type(ids) is list and type(prompt) is list and type(content) is list):
            return None
        if set(map(type, ids)) != {int} or set(map(type, prompt)) != {int}:
            return None  # bools and floats are refused by the JSON path; leave it to say so
        values = [entry["logprob"] for entry in content]
        if not set(map(type, values)) <= {float, int}:
            return None
        logprobs = array("d", values)
        prompt_bytes, response_bytes = _u32(prompt), _u32(ids)
    except (KeyError, TypeError, OverflowError, ValueError):
        return None
    if len(logprobs) != len(ids):
        return None
    stripped = {k: v for k, v in response.items() if k != "prompt_token_ids"}
    stripped["choices"] = [{k: v for k, v in choice.items() if k not in _STRIPPED}]
    try:
        meta = b"".join((head_json[:-1], b',"response":', orjson.dumps(stripped), b"}"))
    except TypeError:
        return None
    if not _LITTLE:
        logprobs.byteswap()
    return b"".join((_HEADER.pack(_MAGIC, len(meta), len(prompt), len(ids)), meta, prompt_bytes, response_bytes,
                     logprobs.tobytes()))


def unpack_after(body: bytes) -> tuple[dict[str, Any], PackedArrays]:
    """(the JSON hook body, its arrays). Raises PackedBodyError for a malformed body. Values are not checked
    here beyond their framing: the capture's validation does that (`online/capture/response.py:
    validate_packed_response`)."""
    if len(body) < _HEADER.size:
        raise PackedBodyError("packed body shorter than its header")
    magic, json_len, prompt_count, response_count = _HEADER.unpack_from(body)
    if magic != _MAGIC:
        raise PackedBodyError("packed body has an unknown magic")
    ids_at = _HEADER.size + json_len
    logprobs_at = ids_at + 4 * (prompt_count + response_count)
    if len(body) != logprobs_at + 8 * response_count:
        raise PackedBodyError("packed body length does not match its header")
    try:
        head = json_nesting.loads(body[_HEADER.size:ids_at],
                                  max_depth=json_nesting.MAX_DEPTH + json_nesting.HOOK_WRAPPING)
    except json_nesting.TooDeep as exc:
        raise PackedBodyError(f"packed body's JSON part is {exc}") from None
    except orjson.JSONDecodeError as exc:
        raise PackedBodyError("packed body's JSON part is not valid JSON") from exc
    if not isinstance(head, dict):
        raise PackedBodyError("packed body's JSON part must be an object")
    logprobs = array("d")
    logprobs.frombytes(body[logprobs_at:])
    if not _LITTLE:
        logprobs.byteswap()
    split = ids_at + 4 * prompt_count
    return head, PackedArrays(body[ids_at:split], body[split:logprobs_at], logprobs)
