"""HMAC key material shared by the gateway and its clients (CONTRACT §3.1, §3.2): how a key string decodes, what an
agent key id looks like, and the key file a client signs with.

Two key files exist, with different holders:

- the gateway's key file (`global.hmacKeyFile`, the operator's): `{"apiHmacKey", "insHmacKey"?, "agentHmacKeys"?}`;
  a client that reads it signs with `apiHmacKey`, the operator key;
- an agent's own key file (`openjiuwen-rl keys add-agent` writes it): `{"agentKeyId", "agentHmacKey"}`, one agent
  key and nothing else, so an agent never needs the operator's file.

Key material never appears in an error message or a repr.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from .bounded_files import FileReadError, read_bounded

MIN_KEY_BYTES = 32  # CONTRACT §3.1: 32-byte keys
MAX_KEY_BYTES = 1024
MAX_KEY_FILE_BYTES = 64 * 1024  # a key file holds a few short strings
_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")
# Agent key ids travel in a header (X-Key-Id), in the Task record and in log lines: short, printable, no separators
# a header or a log could misread.
AGENT_KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class KeyFileError(ValueError):
    """A key file cannot be read or is not a valid key document. Names the file and the member, never a value."""


def decode_key(text: str) -> bytes:
    """The key bytes of a key string: 64 hex digits are decoded to 32 bytes, any other string is its UTF-8 bytes.

    :raises ValueError: when the result is shorter than 32 or longer than 1024 bytes (the message never quotes it).
    """
    key = bytes.fromhex(text) if _HEX_KEY.fullmatch(text) else text.encode("utf-8")
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"must be 64 hex digits or a string of {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes")
    return key


def is_agent_key_id(value: object) -> bool:
    return isinstance(value, str) and AGENT_KEY_ID.fullmatch(value) is not None


@dataclass(frozen=True, slots=True)
class SigningKey:
    """The key a client signs with: the operator key (`key_id` None) or one agent key (`key_id` its id)."""

    key: bytes = field(repr=False)
    key_id: str | None = None

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("key must not be empty")
        if self.key_id is not None and not is_agent_key_id(self.key_id):
            raise ValueError("key_id must match [A-Za-z0-9][A-Za-z0-9._-]{0,63}")

    @property
    def is_agent(self) -> bool:
        return self.key_id is not None

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self.key_id!r}, key=<{len(self.key)} bytes>)"


def signing_key_from_document(data: Any, *, source: str) -> SigningKey:
    """The key of a parsed key file: an agent's file gives its agent key, the gateway's file the operator key. A
    document holding both kinds is refused: which one to sign with would be a guess."""
    if not isinstance(data, Mapping):
        raise KeyFileError(f"{source}: must be a JSON object")
    if "agentHmacKey" in data and "apiHmacKey" in data:
        raise KeyFileError(f"{source}: holds both apiHmacKey and agentHmacKey; an agent's key file holds only its "
                           "own key")
    if "agentHmacKey" in data:
        key_id, text = data.get("agentKeyId"), data["agentHmacKey"]
        if not is_agent_key_id(key_id):
            raise KeyFileError(f"{source}: agentKeyId: required, matching [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}")
        return SigningKey(member_key(text, "agentHmacKey", source), key_id)
    if "apiHmacKey" in data:
        return SigningKey(member_key(data["apiHmacKey"], "apiHmacKey", source))
    raise KeyFileError(f"{source}: neither apiHmacKey (the gateway's key file) nor agentHmacKey (an agent's key file)")


def member_key(text: Any, member: str, source: str) -> bytes:
    """One key member of a key document (the gateway's key file, an agent's key file, the crypto socket's answer):
    a non-empty string of 64 hex digits or 32..1024 bytes. Both processes' parsers read keys through it."""
    if not isinstance(text, str) or not text:
        raise KeyFileError(f"{source}: {member}: required, a non-empty string")
    try:
        return decode_key(text)
    except ValueError as exc:
        raise KeyFileError(f"{source}: {member}: {exc}") from None


def read_key_document(path: str) -> Any:
    """The parsed JSON of a key file (at most 64 KiB)."""
    try:
        raw = read_bounded(path, f"key file {path}", MAX_KEY_FILE_BYTES)
    except FileReadError as exc:
        raise KeyFileError(str(exc)) from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise KeyFileError(f"key file {path} is not JSON") from None  # never quoted: it holds key material


def load_signing_key(path: str) -> SigningKey:
    """The key a client signs with, from the gateway's key file (operator) or an agent's key file (agent)."""
    return signing_key_from_document(read_key_document(path), source=path)


def load_agent_key(path: str) -> SigningKey:
    """An agent key from an agent's key file; the operator's key file is refused, so an agent process is never
    handed more than it needs."""
    key = load_signing_key(path)
    if not key.is_agent:
        raise KeyFileError(f"{path} is the gateway's (operator's) key file; an agent signs with its own agent key "
                           "(openjiuwen-rl keys add-agent ID writes one)")
    return key
