"""The fencing token of the leader's duties: every leader-only Redis write lands only while the term of office that
made it is still the lease's current term.

Fencing by time (workers/coordinator.py) stops a leader's duties before its lease can expire, but only if its event loop
runs: a process stopped for longer than the TTL (SIGSTOP, a VM pause, a swap storm) resumes with writes already
queued, and they would run before its timer tells it that it was deposed. So each such write carries the token of
its term — this worker's holder value and the epoch of the lease when it won it (workers/lease.py) — and Redis checks it in
the same atomic step as the write:

- a MULTI/EXEC transaction WATCHes the epoch counter, reads the lease and the epoch, and writes only if both are
  still this term's: every new term increments the epoch (in the acquisition script), so an EXEC that would land
  after another worker took over fails its WATCH, and the retry finds the term over. The lease key itself is not
  WATCHed: its holder renews it every second, and each renewal would abort the holder's own transactions. So an
  EXEC may still land after the lease lapsed but before anyone won it again: no other term has begun then, which
  is all the token promises (no write of term N after term N+1 began);
- a Lua script starts with `LUA_CHECK` (the lease key and the epoch key as its first two KEYS, the holder value and
  the epoch as its first two ARGV) and answers `LEASE_LOST` instead of writing.

A refused write raises `LeaseLost`: the duty stops, writes nothing more, and leaves its work to the next leader,
whose takeover recovery settles it. The fence also remembers locally that the term is over (deposed by the
coordinator, or refused by Redis once), so later writes of that term fail without a round trip.

A lone service (`workers: 1`) holds no lease and is the leader for its whole life: its duties write `UNFENCED`, as
do the writes any worker makes (capture hooks, Task routes, rewards).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from . import keys
from .tx import transact

T = TypeVar("T")

LEASE_LOST_REPLY = "LEASE_LOST"
# The first lines of every leader-only Lua script. KEYS[1] the lease, KEYS[2] the epoch counter; ARGV[1] the holder
# value, ARGV[2] the epoch of the term. The script's own keys and arguments follow from index 3.
LUA_CHECK = f"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return redis.error_reply('{LEASE_LOST_REPLY} the lease is no longer held by this term')
end
"""

Body = Callable[[Pipeline], Awaitable[T]]


class LeaseLost(RuntimeError):
    """A leader-only write was refused: this worker's term of office is over (another worker holds the lease, or
    its own lease lapsed). The caller stops its duty; the next leader settles what it leaves."""


class Fence(Protocol):
    """How a leader-only write reaches Redis: `transact` for a WATCH → read → MULTI/EXEC body (store/tx.py),
    `write` for writes that read nothing first (queued into one MULTI/EXEC)."""

    def grant(self, epoch: int) -> None: ...

    def revoke(self) -> None: ...

    async def transact(self, redis: Redis, body: Body[T], *watch: str) -> T: ...

    async def write(self, redis: Redis, queue: Callable[[Pipeline], object]) -> list[Any]: ...


class Unfenced:
    """Writes of a lone service's duties, and of any worker: no lease, nothing to check."""

    def grant(self, epoch: int) -> None:
        """A lone service's term never ends: nothing to record."""

    def revoke(self) -> None:
        """Nothing to revoke: see `grant`."""

    async def transact(self, redis: Redis, body: Body[T], *watch: str) -> T:
        return await transact(redis, body, *watch)

    async def write(self, redis: Redis, queue: Callable[[Pipeline], object]) -> list[Any]:
        return await transact(redis, _queued(queue))


UNFENCED = Unfenced()


class LeaseFence:
    """The token of one worker's terms: its holder value (`lease.Holder.value`) and the epoch of the term it holds
    now, None while it holds none. The coordinator grants a term when it wins the lease and revokes it when it
    deposes itself; a write takes the epoch current when it starts and keeps it through its retries."""

    def __init__(self, holder: str) -> None:
        self.holder = holder
        self._holder = holder.encode()
        self._epoch: int | None = None

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def grant(self, epoch: int) -> None:
        if epoch < 1:
            raise ValueError("a term's epoch is positive")
        self._epoch = epoch

    def revoke(self) -> None:
        self._epoch = None

    def script_args(self) -> tuple[list[str], list[str]]:
        """The KEYS and ARGV a script starting with `LUA_CHECK` takes first. LeaseLost when no term is held."""
        return [keys.LEADER, keys.LEADER_EPOCH], [self.holder, self._token().decode()]

    async def transact(self, redis: Redis, body: Body[T], *watch: str) -> T:
        token = self._token()

        async def fenced(pipe: Pipeline) -> T:
            holder, epoch = await pipe.mget(keys.LEADER, keys.LEADER_EPOCH)
            # Invariant: this body's EXEC lands only while the lease names this holder in this term. A lapsed lease
            # (holder gone) or a later term (epoch moved) refuses here; a takeover after this read INCRs the WATCHed
            # epoch and fails the EXEC, and the retry refuses here.
            if holder != self._holder or epoch != token:
                self._lost(token)
                raise LeaseLost(f"leader term {token.decode()} is over (the lease holds term "
                                f"{(epoch or b'-').decode()})")
            return await body(pipe)

        # The epoch is WATCHed with the body's keys (one WATCH): a takeover between this check and the EXEC fails it.
        return await transact(redis, fenced, keys.LEADER_EPOCH, *watch)

    async def write(self, redis: Redis, queue: Callable[[Pipeline], object]) -> list[Any]:
        return await self.transact(redis, _queued(queue))

    def _token(self) -> bytes:
        """This term's epoch; LeaseLost when none is held (never won, deposed, or refused once): fail closed."""
        if self._epoch is None:
            raise LeaseLost("this worker holds no leader term")
        return str(self._epoch).encode()

    def _lost(self, token: bytes) -> None:
        """Redis refused `token`: that term is over here too (a later term of this process stays)."""
        if self._epoch is not None and str(self._epoch).encode() == token:
            self._epoch = None


def is_lease_lost(exc: BaseException) -> bool:
    """Whether a script's error reply is `LUA_CHECK`'s refusal."""
    return str(exc).startswith(LEASE_LOST_REPLY)


def _queued(queue: Callable[[Pipeline], object]) -> Body[list[Any]]:
    async def body(pipe: Pipeline) -> list[Any]:
        pipe.multi()
        queue(pipe)
        return await pipe.execute()

    return body
