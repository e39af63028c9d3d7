"""HMAC key material shared by the gateway and its clients (CONTRACT §3.1, §3.2): how a key string decodes, what an
agent key id looks like, and every key document parsed in one place (issue 39 item 5).

Two key files exist, with different holders:

- the gateway's key file (`global.hmacKeyFile`, the operator's): `{"apiHmacKey", "insHmacKey"?, "agentHmacKeys"?}`;
  the gateway reads all of it (`HmacKeys`, `read_gateway_keys`; the same document may come from AIGW's crypto
  socket), and must find it private to its user; a client that reads it signs with `apiHmacKey`, the operator key;
- an agent's own key file (`openjiuwen-rl keys add-agent` writes it): `{"agentKeyId", "agentHmacKey"}`, one agent
  key and nothing else, so an agent never needs the operator's file.

No two keys of the gateway's document may be equal: each holder's key must prove that holder. Key material never
appears in an error message or a repr.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .bounded_files import FileReadError, read_json
from .lineage import is_lineage

MIN_KEY_BYTES = 32  # CONTRACT §3.1: 32-byte keys
MAX_KEY_BYTES = 1024
MAX_KEY_DOCUMENT_BYTES = 64 * 1024  # a key document (file or crypto socket answer) holds a few short strings per key
AGENT_KEY_LINEAGES = "lineages"  # an agent key entry's lineage limit (docs/gateway.md, docs/lineages.md)
# an agent key entry's cap on the lineages it may register (docs/lineages.md "Lifecycle", docs/security.md)
AGENT_KEY_MAX_LINEAGES = "maxLineages"
MAX_LINEAGES_CAP = 1_000_000
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
    a non-empty string of 64 hex digits or 32..1024 bytes. Every key document parser here reads keys through it."""
    if not isinstance(text, str) or not text:
        raise KeyFileError(f"{source}: {member}: required, a non-empty string")
    try:
        return decode_key(text)
    except ValueError as exc:
        raise KeyFileError(f"{source}: {member}: {exc}") from None


def read_key_document(path: str) -> Any:
    """The parsed JSON of a key file (at most 64 KiB, duplicate keys refused)."""
    try:
        return read_json(path, f"key file {path}", MAX_KEY_DOCUMENT_BYTES)
    except FileReadError as exc:
        raise KeyFileError(str(exc)) from None  # position and problem only: the file holds key material


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


# --- the gateway's key document -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HmacKeys:
    """The HMAC keys (CONTRACT §3.1, §3.2): the operator's, the instance key, and the agent keys by id. The repr shows
    only their sizes and the agent key ids."""

    api: bytes = field(repr=False)
    ins: bytes | None = field(default=None, repr=False)
    agents: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    # agent key id → the lineages it may start Tasks in; a key absent here may use every lineage
    agent_lineages: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # agent key id → how many lineages it may register (its first Task in a lineage new to the RL Service); absent:
    # no cap of its own (`lineages.max_count` still bounds the registry)
    agent_lineage_caps: Mapping[str, int] = field(default_factory=dict)

    def __repr__(self) -> str:
        ins = "none" if self.ins is None else f"<{len(self.ins)} bytes>"
        return f"HmacKeys(api=<{len(self.api)} bytes>, ins={ins}, agents={sorted(self.agents)})"


def gateway_keys_from_document(data: Any, *, source: str) -> HmacKeys:
    """`{"apiHmacKey": str, "insHmacKey": str?, "agentHmacKeys": [{"id": str, "key": str}]?}` → HmacKeys.

    Other top-level members are ignored (AIGW's crypto socket may send more); an absent, null or empty `insHmacKey`
    means register-instance accepts only the api key; an absent or null `agentHmacKeys` means no agent keys. An agent
    key entry has `id`, `key` and optionally `lineages` (the lineages it may start Tasks in; absent: all) and
    `maxLineages`: any other member may be a restriction the gateway would not apply, so it is refused. Ids are
    unique; no two keys of the document are equal.

    :raises KeyFileError: naming `source` and the member, never a key.
    """
    if not isinstance(data, Mapping):
        raise KeyFileError(f"{source}: must be a JSON object")
    api = member_key(data.get("apiHmacKey"), "apiHmacKey", source)
    ins = data.get("insHmacKey")
    if ins is not None and not isinstance(ins, str):
        raise KeyFileError(f"{source}: insHmacKey: must be a string")
    named = {"apiHmacKey": api}
    if ins:
        named["insHmacKey"] = member_key(ins, "insHmacKey", source)
    agents, limits, caps = _agent_keys(data.get("agentHmacKeys"), source)
    named.update({f"agentHmacKeys[{i}] (id {key_id!r})": key for i, (key_id, key) in enumerate(agents.items())})
    _refuse_equal_keys(named, source)
    return HmacKeys(api=named["apiHmacKey"], ins=named.get("insHmacKey"), agents=agents, agent_lineages=limits,
                    agent_lineage_caps=caps)


def read_gateway_keys(path: str | os.PathLike[str], *, where: str) -> HmacKeys:
    """The gateway's key file, refused when group or others may read or write it (checked on the opened file).

    :param where: how messages name the file, e.g. ``f"hmacKeyFile {path}"``.
    """
    try:
        data = read_json(path, where, MAX_KEY_DOCUMENT_BYTES, private_to="the gateway's user")
    except FileReadError as exc:
        raise KeyFileError(str(exc)) from None
    return gateway_keys_from_document(data, source=where)


def _agent_keys(entries: Any, source: str) -> tuple[dict[str, bytes], dict[str, frozenset[str]], dict[str, int]]:
    """(key by id, lineage limit by id, registration cap by id, for the keys that have them)."""
    if entries is None:
        return {}, {}, {}
    if not isinstance(entries, list):
        raise KeyFileError(f"{source}: agentHmacKeys: must be a list of {{\"id\", \"key\"}} objects")
    agents: dict[str, bytes] = {}
    limits: dict[str, frozenset[str]] = {}
    caps: dict[str, int] = {}
    optional = {AGENT_KEY_LINEAGES, AGENT_KEY_MAX_LINEAGES}
    for i, entry in enumerate(entries):
        where = f"agentHmacKeys[{i}]"
        # A member the gateway does not know may be a restriction it would not apply: refused (fail closed).
        if not isinstance(entry, Mapping) or not {"id", "key"} <= set(entry) <= {"id", "key", *optional}:
            raise KeyFileError(f"{source}: {where}: must be an object with exactly the members id and key "
                               f"(and optionally {AGENT_KEY_LINEAGES}, {AGENT_KEY_MAX_LINEAGES})")
        if AGENT_KEY_LINEAGES in entry:
            limits[str(entry["id"])] = _lineage_limit(entry[AGENT_KEY_LINEAGES], f"{source}: {where}")
        if AGENT_KEY_MAX_LINEAGES in entry:
            caps[str(entry["id"])] = _lineage_cap(entry[AGENT_KEY_MAX_LINEAGES], f"{source}: {where}")
        key_id, text = entry["id"], entry["key"]
        if not is_agent_key_id(key_id):
            raise KeyFileError(f"{source}: {where}.id: must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}")
        if key_id in agents:
            raise KeyFileError(f"{source}: {where}.id: duplicate id {key_id!r}")
        agents[key_id] = member_key(text, f"{where}.key", source)
    return agents, limits, caps


def _lineage_cap(value: Any, where: str) -> int:
    """How many lineages an agent key may register: an integer in 0..1,000,000 (0: none)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LINEAGES_CAP:
        raise KeyFileError(f"{where}.{AGENT_KEY_MAX_LINEAGES}: must be an integer in 0..{MAX_LINEAGES_CAP} "
                           "(0: the key registers no lineage)")
    return value


def _lineage_limit(value: Any, where: str) -> frozenset[str]:
    """The lineages an agent key may use: a list of lineage names (empty: none; a typo must not grant everything)."""
    if not isinstance(value, list) or not all(is_lineage(name) for name in value):
        raise KeyFileError(f"{where}.{AGENT_KEY_LINEAGES}: must be a list of lineage names (lower-case letters, "
                           "digits and '-', 1-63 characters, not 'v' followed by digits)")
    return frozenset(value)


def _refuse_equal_keys(named: Mapping[str, bytes], source: str) -> None:
    """Each key proves one holder: a key shared by two roles (or two agents) would let either act as the other."""
    seen: dict[bytes, str] = {}
    for member, key in named.items():
        if key in seen:
            raise KeyFileError(f"{source}: {member} is the same key as {seen[key]}; every role and every agent "
                               "needs its own key")
        seen[key] = member
