"""Domain errors of the RL Service mapped onto the contract's error envelope (common/errors.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from ...common.errors import ApiError
from ...common.ids import InvalidIdentifier
from ..errors import Conflict, InvalidInput, JudgeFailed, NotFound
from ..store.fence import LeaseLost

log = logging.getLogger("openjiuwen.agent_rl.online.api")


@contextmanager
def domain_errors(*, not_found: str, conflict: str, invalid: str | None = None) -> Iterator[None]:
    """Translate domain errors raised inside the block into the route's codes."""
    try:
        yield
    except InvalidInput as exc:
        raise ApiError(400, invalid or exc.code or "invalid_request", exc.message) from exc
    except InvalidIdentifier as exc:
        raise ApiError(404, not_found, str(exc)) from exc
    except NotFound as exc:
        raise ApiError(404, not_found, exc.message) from exc
    except Conflict as exc:
        raise ApiError(409, exc.code or conflict, exc.message) from exc
    except LeaseLost as exc:
        # A leader-only route on a worker deposed meanwhile: nothing of it was written after the refusal; the
        # caller retries and the request is relayed to the new leader.
        raise ApiError(503, "service_not_ready",
                       "this RL Service worker is no longer the leader; retry shortly") from exc
    except JudgeFailed as exc:
        # The contract answers a Judge failure with the plain 500 envelope; the cause goes to the log only.
        log.warning("judge failure: %s", exc.message)
        raise ApiError(500, "internal_error", "internal service error") from exc
