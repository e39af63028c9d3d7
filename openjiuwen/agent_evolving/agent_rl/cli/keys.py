"""`openjiuwen-rl keys ...`: mint the gateway's HMAC keys (CONTRACT §3.1), each file private to its owner (0600).

    openjiuwen-rl keys init /etc/openjiuwen/gateway-keys.json
    openjiuwen-rl keys add-agent support-bot --key-file /etc/openjiuwen/gateway-keys.json --out support-bot.key.json
    openjiuwen-rl keys add-agent tenant-7 --max-lineages 50 --key-file ... --out tenant-7.key.json

`init` writes a new gateway key file with a fresh operator key (`apiHmacKey`) and instance key (`insHmacKey`).
`add-agent` adds a fresh agent key to the gateway's key file (`agentHmacKeys`) and writes the agent's own key file
`{"agentKeyId", "agentHmacKey"}`, the only file the agent gets: with it the agent may start, stop and reward its own
Tasks and upload rail batches, nothing else. `--max-lineages N` caps the lineages the key may register (its first
Task in a lineage new to the RL Service; docs/lineages.md "Lifecycle"), so one key cannot fill `lineages.max_count`.
The gateway reads its key file at start: restart it to load a new key.
Keys are 32 random bytes, written as 64 hex digits; they are never printed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from ..common.private_files import write_private
from ..common.signing_keys import (
    AGENT_KEY_MAX_LINEAGES,
    KeyFileError,
    gateway_keys_from_document,
    is_agent_key_id,
    read_key_document,
)


class KeysError(Exception):
    """A failure to report as `error: <message>` (exit status 2)."""


def _fresh_key() -> str:
    return secrets.token_hex(32)


def _dump(document: dict[str, Any]) -> bytes:
    return orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n"


def _create(path: Path, document: dict[str, Any]) -> None:
    try:
        write_private(path, _dump(document))  # 0600, never over an existing file or through a symlink
    except FileExistsError:
        raise KeysError(f"{path} already exists; keys are never overwritten") from None
    except OSError as exc:
        raise KeysError(f"cannot write {path}: {exc.strerror or type(exc).__name__}") from None


def _replace(path: Path, document: dict[str, Any]) -> None:
    """Write `document` to `path` at once: a private temporary file beside it, then a rename, so the gateway never
    reads half a key file and the file is never open to others."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(_dump(document))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def init(path: Path) -> str:
    _create(path, {"apiHmacKey": _fresh_key(), "insHmacKey": _fresh_key()})
    return f"wrote {path} (mode 0600): apiHmacKey (operator) and insHmacKey (vLLM instance registration)"


def add_agent(key_id: str, gateway_keys: Path, out: Path, *, max_lineages: int | None = None) -> str:
    if not is_agent_key_id(key_id):
        raise KeysError("an agent key id must match [A-Za-z0-9][A-Za-z0-9._-]{0,63}")
    try:
        document = read_key_document(str(gateway_keys))
    except KeyFileError as exc:
        raise KeysError(str(exc)) from None
    if not isinstance(document, dict) or "apiHmacKey" not in document:
        raise KeysError(f"{gateway_keys} is not the gateway's key file (it has no apiHmacKey)")
    entries = document.get("agentHmacKeys") or []
    if not isinstance(entries, list):
        raise KeysError(f"{gateway_keys}: agentHmacKeys: must be a list")
    if any(isinstance(entry, dict) and entry.get("id") == key_id for entry in entries):
        raise KeysError(f"{gateway_keys} already has an agent key {key_id!r}")
    key = _fresh_key()
    entry: dict[str, Any] = {"id": key_id, "key": key}
    if max_lineages is not None:
        entry[AGENT_KEY_MAX_LINEAGES] = max_lineages
    updated = {**document, "agentHmacKeys": [*entries, entry]}
    try:
        gateway_keys_from_document(updated, source=str(gateway_keys))  # what the gateway checks at its next start
    except KeyFileError as exc:
        raise KeysError(str(exc)) from None
    _create(out, {"agentKeyId": key_id, "agentHmacKey": key})
    try:
        _replace(gateway_keys, updated)
    except OSError as exc:
        out.unlink(missing_ok=True)  # no agent file for a key the gateway does not have
        raise KeysError(f"cannot write {gateway_keys}: {exc.strerror or type(exc).__name__}") from None
    return (f"added agent key {key_id!r} to {gateway_keys}; the agent's key file is {out} (mode 0600). Restart the "
            "gateway to load it.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openjiuwen-rl keys",
                                     description="Mint the gateway's HMAC keys; every file is written mode 0600.",
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = actions.add_parser("init", help="write a new gateway key file (operator and instance keys), mode 0600")
    p.add_argument("file", type=Path, help="the gateway's key file to create (global.hmacKeyFile)")
    p = actions.add_parser("add-agent", help="add an agent key to the gateway's key file and write the agent's own "
                                             "key file (mode 0600)")
    p.add_argument("id", help="the agent key's id, e.g. support-bot ([A-Za-z0-9][A-Za-z0-9._-]{0,63})")
    p.add_argument("--key-file", type=Path, required=True, help="the gateway's key file (global.hmacKeyFile)")
    p.add_argument("--out", type=Path, required=True, help="the agent's key file to create")
    p.add_argument("--max-lineages", type=int, metavar="N",
                   help="the most lineages this key may register (maxLineages; 0: none; default: no cap of its own)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.action == "init":
            message = init(args.file)
        else:
            message = add_agent(args.id, args.key_file, args.out, max_lineages=args.max_lineages)
    except KeysError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
