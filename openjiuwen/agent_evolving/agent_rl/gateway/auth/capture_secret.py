"""Optional per-Task capture secrets (issue 19 item 6).

A session id is a capability: whoever knows it can write completions into the session's active Task. A Task started
with `{"capture_secret": true}` gets a random secret, returned once in the start answer; every inference call of its
session must then carry it in `X-Agent-Capture-Secret`, or it is refused (403) and nothing is captured. The gateway
keeps only the SHA-256 of the secret, in the session's binding (memory), so the check lives exactly as long as the
session → Task mapping it guards; the secret itself is never stored, logged or sent to the RL Service.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

HEADER = "x-agent-capture-secret"
REQUEST_FIELD = "capture_secret"  # in the signed Task start body; removed before it is forwarded
ANSWER_FIELD = "capture_secret"  # in the Task start answer, once
SECRET_BYTES = 32


def mint() -> tuple[str, bytes]:
    """(the secret for the client, its digest for the gateway)."""
    secret = secrets.token_urlsafe(SECRET_BYTES)
    return secret, digest(secret)


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


def matches(presented: str | None, expected: bytes) -> bool:
    """Constant-time: the digests have one length whatever was presented."""
    if presented is None:
        return False
    return hmac.compare_digest(digest(presented), expected)
