"""The RL Service's routes (CONTRACT §2.2), each once, with what the other side needs to know about it.

Per route:
- `gateway`: how the reference gateway serves it (CONTRACT §3.3): `OPERATOR` / `AGENT` = proxied unchanged under
  the same method and path, signed with the api key only / the api key or an agent key; `OWN` = served by a
  gateway handler of its own that calls the route (Task start with pinning, stop with drain, reward behind the
  lineage check); None = not on the gateway (hooks, internal calls, health, metrics, the OpenAPI document);
- `idempotent`: a POST whose repeat answers the same (the RL Service's idempotency, CONTRACT §2.4, §2.5), so the
  gateway sends it again when its connection broke before an answer; a GET always is;
- `leader_only`: it changes state only the leader worker holds in process (the Training Runner, the rollout
  controller), so a follower relays it to the leader (online/workers/forward.py).

tests/unit/test_wire_routes.py fails when a route of the RL Service app has no entry here, an entry matches no
route, or the gateway app serves a flagged route otherwise than flagged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import quote


class Gateway(StrEnum):
    OPERATOR = "operator"
    AGENT = "agent"
    OWN = "own"


_PARAM = re.compile(r"\{(\w+)\}")
_SEGMENT_SAFE = ":@!$&'()*+,;=-._~"


def _pattern(path: str) -> re.Pattern[str]:
    """The path template as a regex: a `{name}` is one non-empty segment, as Starlette's default converter."""
    parts = _PARAM.split(path)  # literal, name, literal, name, ...
    return re.compile("^" + "".join(re.escape(p) if i % 2 == 0 else "[^/]+" for i, p in enumerate(parts)) + "$")


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str  # the template as the RL Service's router declares it
    gateway: Gateway | None = None
    idempotent: bool = False
    leader_only: bool = False
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", _pattern(self.path))

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and self.pattern.match(path) is not None

    def at(self, *values: str) -> tuple[str, str]:
        """(method, path) of a call: what every client (the CLI, the demo) sends instead of spelling the path."""
        return self.method, self.fill(*values)

    def fill(self, *values: str) -> str:
        """The path with its parameters in order, each kept one segment (`/`, `?`, `#`, spaces… escaped; the
        characters of ids, `:` included, as they are)."""
        values_iter = iter(values)
        return _PARAM.sub(lambda _: quote(next(values_iter), safe=_SEGMENT_SAFE), self.path)


O, A, OWN = Gateway.OPERATOR, Gateway.AGENT, Gateway.OWN

HEALTH = Route("GET", "/health")
METRICS = Route("GET", "/metrics")
OPENAPI = Route("GET", "/openapi.json")

TASK_START = Route("POST", "/v1/rl/tasks/start", OWN, idempotent=True)  # with the Task id the gateway minted
TASK_LIST = Route("GET", "/v1/rl/tasks", O)
TASK = Route("GET", "/v1/rl/tasks/{rl_task_id}", O)
TASK_STOP = Route("POST", "/v1/rl/tasks/{rl_task_id}/stop", OWN, idempotent=True)
TASK_REWARD = Route("POST", "/v1/rl/tasks/{rl_task_id}/reward", OWN, idempotent=True)
TASK_EVENTS = Route("GET", "/v1/rl/tasks/{rl_task_id}/events", O)

RUN_START = Route("POST", "/v1/rl/training/runs", O, leader_only=True)
RUN_LIST = Route("GET", "/v1/rl/training/runs", O)
RUN = Route("GET", "/v1/rl/training/runs/{training_run_id}", O)
RUN_STOP = Route("POST", "/v1/rl/training/runs/{training_run_id}/stop", O, leader_only=True)
RUN_EVENTS = Route("GET", "/v1/rl/training/runs/{training_run_id}/events", O)

# `stats`, `exclude` and `rewards` before the `{trajectory_id}` routes: the gateway registers them in this order.
TRAJECTORY_STATS = Route("GET", "/v1/rl/trajectories/stats", O)
TRAJECTORY_LIST = Route("GET", "/v1/rl/trajectories", O)
TRAJECTORY_EXCLUDE = Route("POST", "/v1/rl/trajectories/exclude", O)
TRAJECTORY_REWARDS = Route("POST", "/v1/rl/trajectories/rewards", O)
TRAJECTORY = Route("GET", "/v1/rl/trajectories/{trajectory_id}", O)
TRAJECTORY_REWARD = Route("POST", "/v1/rl/trajectories/{trajectory_id}/rewards", O)

POLICIES = Route("GET", "/v1/rl/policies", O)
ROLLOUT = Route("GET", "/v1/rl/rollout", O)
ROLLOUT_PROMOTE = Route("POST", "/v1/rl/rollout/promote", O, leader_only=True)
ROLLOUT_ROLLBACK = Route("POST", "/v1/rl/rollout/rollback", O, leader_only=True)
ROLLOUT_PAUSE = Route("POST", "/v1/rl/rollout/pause", O, leader_only=True)
ROLLOUT_RESUME = Route("POST", "/v1/rl/rollout/resume", O, leader_only=True)
ROLLOUT_EVENTS = Route("GET", "/v1/rl/rollout/{rollout_id}/events", O)
LORA_ACTIVATE = Route("POST", "/v1/rl/loras/activate", O, leader_only=True)

LINEAGE_LIST = Route("GET", "/v1/rl/lineages", O)
LINEAGE = Route("GET", "/v1/rl/lineages/{lineage}", O)
LINEAGE_PAUSE = Route("POST", "/v1/rl/lineages/{lineage}/pause", O)
LINEAGE_RESUME = Route("POST", "/v1/rl/lineages/{lineage}/resume", O)
# The lifecycle (docs/lineages.md "Lifecycle"): the leader serializes them with runs and rollouts and finishes them.
LINEAGE_ARCHIVE = Route("POST", "/v1/rl/lineages/{lineage}/archive", O, leader_only=True)
LINEAGE_RESTORE = Route("POST", "/v1/rl/lineages/{lineage}/restore", O, leader_only=True)
LINEAGE_DELETE = Route("POST", "/v1/rl/lineages/{lineage}/delete", O, leader_only=True)

RAIL_BATCH = Route("POST", "/v1/gateway/upload/batch", A)

# Capture hooks and the internal Task ends: the gateway's calls to its child (CONTRACT §2.8, §2.9).
HOOK_BEFORE = Route("POST", "/internal/v1/completions:before")
HOOK_AFTER = Route("POST", "/internal/v1/completions:after")
HOOK_DISCARD = Route("POST", "/internal/v1/completions:discard")
TASK_FINISH = Route("POST", "/internal/v1/rl/tasks/{rl_task_id}:finish")
TASK_ABORT = Route("POST", "/internal/v1/rl/tasks/{rl_task_id}:abort")

# The gateway's own control routes (served by the gateway itself, never by the RL Service; CONTRACT §3.3).
SERVICE_START = Route("POST", "/v1/rl/service/start")
SERVICE_STOP = Route("POST", "/v1/rl/service/stop")
SERVICE_STATUS = Route("GET", "/v1/rl/service")
GATEWAY_CONTROL: tuple[Route, ...] = (SERVICE_START, SERVICE_STOP, SERVICE_STATUS)

RL_API: tuple[Route, ...] = (
    HEALTH, METRICS, OPENAPI,
    TASK_START, TASK_LIST, TASK, TASK_STOP, TASK_REWARD, TASK_EVENTS,
    RUN_START, RUN_LIST, RUN, RUN_STOP, RUN_EVENTS,
    TRAJECTORY_STATS, TRAJECTORY_LIST, TRAJECTORY_EXCLUDE, TRAJECTORY_REWARDS, TRAJECTORY, TRAJECTORY_REWARD,
    POLICIES, ROLLOUT, ROLLOUT_PROMOTE, ROLLOUT_ROLLBACK, ROLLOUT_PAUSE, ROLLOUT_RESUME, ROLLOUT_EVENTS,
    LORA_ACTIVATE,
    LINEAGE_LIST, LINEAGE, LINEAGE_PAUSE, LINEAGE_RESUME, LINEAGE_ARCHIVE, LINEAGE_RESTORE, LINEAGE_DELETE,
    RAIL_BATCH,
    HOOK_BEFORE, HOOK_AFTER, HOOK_DISCARD, TASK_FINISH, TASK_ABORT,
)
HOOKS = (HOOK_BEFORE, HOOK_AFTER, HOOK_DISCARD)
_IDEMPOTENT_POSTS = tuple(r for r in RL_API if r.method == "POST" and r.idempotent)
LEADER_ROUTES = tuple(r for r in RL_API if r.leader_only)


def proxied(key: Gateway) -> tuple[Route, ...]:
    """The routes the gateway proxies unchanged for `key`, in table order (the order it registers them)."""
    return tuple(r for r in RL_API if r.gateway is key)


def idempotent(method: str, path: str) -> bool:
    """Whether a call answers the same when sent again: any GET or HEAD, and the POSTs flagged so. `path` as sent
    (an id's escapes kept: an escaped `/` stays inside its segment)."""
    return method in ("GET", "HEAD") or any(r.matches(method, path) for r in _IDEMPOTENT_POSTS)


def leader_only(method: str, path: str) -> bool:
    return any(r.matches(method, path) for r in LEADER_ROUTES)
