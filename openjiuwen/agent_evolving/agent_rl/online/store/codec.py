"""Compact sample storage: token ids as packed uint32 LE, logprobs as packed float32 LE (CONTRACT §4.5, D16).

A logical sample document carries `trajectory.prompt_ids`, `trajectory.response_ids` and
`trajectory.response_logprobs` as lists. In Redis those three arrays live only as packed bytes; everything else of
the document is one JSON blob, zlib-compressed when that makes it smaller (it is mostly the request's messages and
the response text: prose compresses several times; `encode_meta`/`decode_meta`, which also read the plain JSON
written before compression existed). A staged sample (one STRING) is the same parts framed in one value, so
publication can move the packed arrays and the meta blob into the trajectory hash without ever decoding them; the
samples of one capture of several choices are their frames back to back in that value.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

MAX_TOKEN_ID = 2**32 - 1  # token ids are packed as uint32: validation refuses larger ones before they get here
_LITTLE = sys.byteorder == "little"
_STAGED_MAGIC = b"RLS1"  # meta as plain JSON (written by earlier versions; still read)
_STAGED_MAGIC_Z = b"RLS2"  # meta as `encode_meta` bytes
_META_ZLIB = b"Z"  # first byte of a compressed meta blob; a JSON object starts with "{"
_META_MIN_COMPRESS = 256  # below this, zlib's framing costs more than it saves
_HEADER = struct.Struct("<4sIIII")  # magic, json length, prompt bytes, response bytes, logprob bytes

def text(raw: bytes | str | None) -> str | None:
    """A Redis value (bytes: the client never decodes, since packed fields are binary) as text; None stays None."""
    if raw is None:
        return None
    return raw.decode() if isinstance(raw, bytes) else raw


def derive_response_text(response: Any) -> str:
    """`trajectory.response_text` as derived from the response: content, else reasoning (vLLM 0.32 `reasoning`,
    older `reasoning_content`), else ""."""
    try:
        message = response["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return ""
    if not isinstance(message, dict):
        return ""
    for key in ("content", "reasoning", "reasoning_content"):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


def encode_meta(meta: dict[str, Any]) -> bytes:
    """The JSON part of a sample as stored: `Z` + zlib (level 1: cheap on the capture path) when smaller, else the
    JSON itself. Raises TypeError for what JSON cannot carry."""
    raw = orjson.dumps(meta)
    if len(raw) < _META_MIN_COMPRESS:
        return raw
    packed = _META_ZLIB + zlib.compress(raw, 1)
    return packed if len(packed) < len(raw) else raw


def decode_meta(blob: bytes | None) -> dict[str, Any]:
    if not blob:
        return {}
    if blob[:1] == _META_ZLIB:
        return orjson.loads(zlib.decompress(blob[1:]))
    return orjson.loads(blob)


def pack_ids(ids: list[int]) -> bytes:
    arr = array("I", ids)  # 'I' is 4 bytes on every platform CPython supports today
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    arr = array("I")
    arr.frombytes(data)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def pack_logprobs(values: list[float]) -> bytes:
    arr = array("f", values)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def unpack_logprobs(data: bytes) -> list[float]:
    arr = array("f")
    arr.frombytes(data)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


@dataclass(slots=True)
class PackedSample:
    """A sample split into its JSON part (arrays removed) and its three packed arrays."""

    meta: dict[str, Any]
    prompt_ids: bytes
    response_ids: bytes
    response_logprobs: bytes

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> "PackedSample":
        meta = dict(doc)
        trajectory = dict(meta.get("trajectory") or {})
        prompt = trajectory.pop("prompt_ids", [])
        response = trajectory.pop("response_ids", [])
        logprobs = trajectory.pop("response_logprobs", [])
        # The response text usually repeats the response's content: keep it only when it says something else.
        if trajectory.get("response_text") == derive_response_text(meta.get("response")):
            trajectory.pop("response_text", None)
        meta["trajectory"] = trajectory
        return cls(meta, pack_ids(prompt), pack_ids(response), pack_logprobs(logprobs))

    def to_document(self) -> dict[str, Any]:
        doc = dict(self.meta)
        trajectory = dict(doc.get("trajectory") or {})
        trajectory["prompt_ids"] = unpack_ids(self.prompt_ids)
        trajectory["response_ids"] = unpack_ids(self.response_ids)
        trajectory["response_logprobs"] = unpack_logprobs(self.response_logprobs)
        trajectory.setdefault("response_text", derive_response_text(doc.get("response")))
        doc["trajectory"] = trajectory
        return doc

    def meta_json(self) -> bytes:
        return orjson.dumps(self.meta)

    def meta_blob(self) -> bytes:
        """The stored form of the JSON part (`sample_json` field, staged value): see `encode_meta`."""
        return encode_meta(self.meta)

    def encode_staged(self) -> bytes:
        body = self.meta_blob()
        header = _HEADER.pack(
            _STAGED_MAGIC_Z, len(body), len(self.prompt_ids), len(self.response_ids), len(self.response_logprobs)
        )
        return b"".join((header, body, self.prompt_ids, self.response_ids, self.response_logprobs))

    @classmethod
    def decode_staged(cls, blob: bytes) -> "PackedSample":
        return cls._frame(blob, 0)[0]

    @classmethod
    def decode_staged_all(cls, blob: bytes) -> list["PackedSample"]:
        """Every sample of a staged value: one, or the frames of a capture of several choices one after another
        (`encode_staged_all`)."""
        samples, pos = [], 0
        while pos < len(blob):
            sample, pos = cls._frame(blob, pos)
            samples.append(sample)
        return samples

    @staticmethod
    def encode_staged_all(samples: "Sequence[PackedSample]") -> bytes:
        """The staged value of a capture's samples: their frames back to back (one frame for one sample, as ever)."""
        return b"".join(sample.encode_staged() for sample in samples)

    @classmethod
    def _frame(cls, blob: bytes, pos: int) -> tuple["PackedSample", int]:
        magic, n_json, n_prompt, n_resp, n_lp = _HEADER.unpack_from(blob, pos)
        if magic not in (_STAGED_MAGIC, _STAGED_MAGIC_Z):
            raise ValueError("not a staged sample")
        pos += _HEADER.size
        meta = decode_meta(blob[pos : pos + n_json])
        pos += n_json
        prompt = blob[pos : pos + n_prompt]
        pos += n_prompt
        resp = blob[pos : pos + n_resp]
        pos += n_resp
        lp = blob[pos : pos + n_lp]
        return cls(meta, prompt, resp, lp), pos + n_lp
