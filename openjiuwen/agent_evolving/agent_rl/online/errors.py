"""Domain errors. They carry the contract's vocabulary (codes, messages) but no HTTP; `api/errors.py` maps them onto the envelope of `common/errors.py`."""

from __future__ import annotations


class DomainError(Exception):
    """Base of every error a caller can cause or observe."""

    code: str | None = None

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidInput(DomainError):
    """The caller sent something malformed (400). `code` is the contract's error code for it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code)


def invalid_completion(message: str) -> InvalidInput:
    """A captured request or completion that breaks the hook contract (400 `invalid_completion`, CONTRACT §2.8)."""
    return InvalidInput("invalid_completion", message)


class NotFound(DomainError):
    """The addressed entity does not exist (404, code chosen by the route)."""


class Conflict(DomainError):
    """The entity exists but its state forbids the operation (409, code chosen by the route unless set)."""


class JudgeFailed(DomainError):
    """Too few Judge votes succeeded; publication could not score a sample."""
