"""Fault injection, for chaos tests only: end the process abruptly at a named point of a code path, or freeze it.

Off by default. The one seam is this module: code reaches a point with `reached("<point>")`, which calls the hook
installed for the whole process. `service.py` installs it once at process start (`install_from_env`): a `CrashAt`
only when the environment variable `ONLINE_RL_CRASH_AT` is set (`[stop:]<point>[@<n>]`: the n-th time the point is
reached, default 1); otherwise the hook stays `no_faults`, a function that does nothing. No class takes a hook.

A crash is `os._exit(CRASH_EXIT_CODE)`: no `finally`, no shutdown, no flush of anything but the log line written
just before, so it stands for a SIGKILL at exactly that point. With `stop:` the
process sends itself SIGSTOP there instead and goes on from that line once something sends it SIGCONT: a process
frozen (a VM pause, a swap storm) with what follows the point already on its way, the stalled leader of
docs/reliability.md.

Each point sits between two durable steps that a real crash could separate; docs/reliability.md says what the
service guarantees at each and names the test that crashes there.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping

log = logging.getLogger("openjiuwen.agent_rl.online.faults")

CRASH_EXIT_CODE = 86
# `[stop:]<point>[@<n>]` of POINTS; unset = no fault. Read once by service.py (`install_from_env`); the worker group
# (workers/group.py) drops it from a crashed worker's heir, so a fault crashes the first workers only.
CRASH_AT_ENV = "ONLINE_RL_CRASH_AT"

POINTS: dict[str, str] = {
    "capture.committed": "`:after` committed the capture, before its 204",
    "task.finalized": "stop finalized the Task, before its 200",
    "turn.inserted": "a delayed turn's judged samples are inserted, before the publication completes",
    "turn.published": "a delayed turn is published, before the next turn becomes current",
    "reward.claimed": "the reward is claimed (`projecting`), before any sample is inserted",
    "reward.inserted": "the reward's samples are inserted, before the projection completes",
    "run.claimed": "a Training Run claimed its batch, before its execution starts",
    "run.trained": "the trainer published the artifact, before the batch is marked trained",
    "run.marked": "the batch is marked trained (`activating`), before the activation call",
    "run.activated": "the gateway switched to the new version, before the run is recorded succeeded",
    "rollout.intent": "a promotion or rollback is recorded as intent, before the gateway call",
    "rollout.switched": "the gateway promoted or dropped the candidate, before the rollout is recorded ended",
    "lineage.purge_batch": "a lineage's deletion removed one batch of its records, before the next one",
}

FaultHook = Callable[[str], None]


def no_faults(point: str) -> None:
    """The default hook: nothing happens at any point."""


class CrashAt:
    """Exit the process the `after`-th time `point` is reached; with `stop`, SIGSTOP it that once instead."""

    def __init__(self, point: str, after: int = 1, *, stop: bool = False) -> None:
        if point not in POINTS:
            raise ValueError(f"unknown crash point {point!r}; known: {', '.join(sorted(POINTS))}")
        if after < 1:
            raise ValueError("a crash point count must be >= 1")
        self.point = point
        self.after = after
        self.stop = stop
        self.hits = 0

    @classmethod
    def parse(cls, spec: str) -> "CrashAt":
        text = spec.strip()
        stop = text.startswith("stop:")
        point, _, count = text.removeprefix("stop:").partition("@")
        try:
            after = int(count) if count else 1
        except ValueError:
            raise ValueError(f"invalid crash point count in {spec!r}") from None
        return cls(point, after, stop=stop)

    def __call__(self, point: str) -> None:
        if point != self.point:
            return
        self.hits += 1
        if self.hits != self.after:
            return
        if self.stop:
            log.warning("fault injection: stopping at %s (hit %d)", point, self.hits)
            os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
            log.warning("fault injection: continued at %s", point)
            return
        log.warning("fault injection: crashing at %s (hit %d)", point, self.hits)
        os._exit(CRASH_EXIT_CODE)


def fault_hook(spec: str | None) -> FaultHook:
    """`no_faults` for an empty spec, else the `CrashAt` it names (ValueError for an unknown point)."""
    return CrashAt.parse(spec) if spec and spec.strip() else no_faults


# The process's hook: one per process, since a spec names one point of the whole process (its n-th hit counts hits
# from every part that reaches it).
_hook: FaultHook = no_faults


def install(hook: FaultHook) -> None:
    """Make `hook` the process's fault hook (`no_faults` turns injection off again)."""
    global _hook
    _hook = hook


def install_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Install the hook `ONLINE_RL_CRASH_AT` names (none when unset); ValueError for a malformed spec."""
    install(fault_hook((os.environ if environ is None else environ).get(CRASH_AT_ENV)))


def reached(point: str) -> None:
    """Code passed `point` (one of POINTS): the installed hook may crash or freeze the process here."""
    _hook(point)
