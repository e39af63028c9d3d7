"""The leader lease: exactly one worker at a time runs the singleton duties (Training Runner, sweepers, rollout
decisions, startup recovery).

The lease is one Redis STRING holding `<boot>:<worker>:<pid>:<port>` with a PX TTL. Its holder renews it well inside
the TTL and counts its own validity from the moment it *sent* the last successful renewal, minus a margin: it stops
its duties before Redis can let the lease expire (fencing by time; coordinator.py). Every acquisition increments an
epoch, so each term of office has its own number; every leader-only write carries it and lands only while it is
still the current term (fencing token; fence.py), which also covers a holder stopped for longer than the TTL.

Two holders are replaced at once instead of after the TTL, because they are known to be dead:
- a holder of an earlier boot of the service: the gateway starts a new RL Service unit only after the old one's
  process group is gone;
- an earlier process of the *same worker slot* of this boot: the worker group restarts slot N only after it reaped
  the process that held it (group.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from ..store import keys
from ..store.fence import LUA_CHECK, LeaseFence, LeaseLost, is_lease_lost

# KEYS: lease, epoch. ARGV: holder value, ttl ms, boot prefix (`<boot>:`), slot prefix (`<boot>:<worker>:`).
# Returns the epoch of this holder's term (new or current), or 0 when another live holder has it.
# Invariant: at most one holder at a time; a holder of another boot or an earlier process of the same slot is
# replaced; the epoch grows with every acquisition.
_ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if current and string.sub(current, 1, string.len(ARGV[3])) == ARGV[3]
   and string.sub(current, 1, string.len(ARGV[4])) ~= ARGV[4] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""
# KEYS: lease, epoch, leader fault. ARGV: holder value, epoch of the term, ttl ms, the leader's health fault ('' when
# healthy). Renews only this holder's current term (LUA_CHECK refuses any other), and publishes the fault for the
# followers' /health in the same step: a deposed leader's stale fault never overwrites its successor's.
_RENEW = LUA_CHECK + """
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if ARGV[4] == '' then
  redis.call('DEL', KEYS[3])
else
  redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[3])
end
return 1
"""
# KEYS: lease, workers. ARGV: member (`<boot>:<slot>:<pid>`). A process known dead (its group reaped it) leaves the
# membership and, if it held the lease, the lease: nobody waits out its TTL. Never touches another holder's lease.
_BURY = """
redis.call('ZREM', KEYS[2], ARGV[1])
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. ':' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
# KEYS: lease. ARGV: holder value. Deletes the lease only if this holder still has it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True)
class Holder:
    """One worker process: its boot, slot, pid and the private loopback port leader-only requests go to."""

    boot: str
    worker: int
    pid: int
    port: int

    @property
    def member(self) -> str:
        """Its name in the membership set (`keys.WORKERS`): one per process, not per slot."""
        return f"{self.boot}:{self.worker}:{self.pid}"

    @property
    def value(self) -> str:
        return f"{self.member}:{self.port}"

    @classmethod
    def parse(cls, raw: bytes | str | None) -> "Holder | None":
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else raw
        parts = text.split(":")
        if len(parts) != 4:
            return None
        try:
            return cls(parts[0], int(parts[1]), int(parts[2]), int(parts[3]))
        except ValueError:
            return None


class LeaderLease:
    def __init__(self, redis: Redis, holder: Holder, *, ttl_s: float) -> None:
        self._redis = redis
        self.holder = holder
        self._ttl_ms = int(ttl_s * 1000)
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def acquire(self) -> int:
        """The epoch of this holder's term (a new one, or the current when it already holds it), or 0."""
        h = self.holder
        return int(await self._acquire(
            keys=[keys.LEADER, keys.LEADER_EPOCH],
            args=[h.value, self._ttl_ms, f"{h.boot}:", f"{h.boot}:{h.worker}:"],
        ))

    async def renew(self, fence: LeaseFence, fault: str | None) -> bool:
        """Extend the term `fence` holds and publish `fault` (None: healthy). False when the term is over."""
        try:
            lease_keys, lease_args = fence.script_args()
            await self._renew(keys=[*lease_keys, keys.LEADER_FAULT], args=[*lease_args, self._ttl_ms, fault or ""])
        except LeaseLost:
            return False
        except ResponseError as exc:
            if is_lease_lost(exc):
                return False
            raise
        return True

    async def release(self) -> None:
        await self._release(keys=[keys.LEADER], args=[self.holder.value])

    async def current(self) -> Holder | None:
        return Holder.parse(await self._redis.get(keys.LEADER))


async def bury(redis: Redis, member: str) -> bool:
    """A worker process is dead (reaped by its group): drop its heartbeat entry and the lease if it held it, so
    its claims are taken over and a new leader elected at once. True when it held the lease."""
    return bool(await redis.eval(_BURY, 2, keys.LEADER, keys.WORKERS, member))
