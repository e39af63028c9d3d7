"""LoRA lifecycle on the vLLM instances: activation, leases, routing, registration and restart (CONTRACT §3.3-§3.9).

What the manager knows per instance is which adapters it holds *confirmed* (`_loaded`: a load answered 200 or "already
been loaded", or `GET /v1/models` listed it) and which it *may* hold (`_stale`: an answer was lost, so a later sweep
unloads again; 404 = gone). Routing trusts only confirmed adapters, so a request never reaches an instance or a
version lacking the adapter.

Concurrency (one event loop): the model lock serializes policy switches (activate, deactivate); a lock per LoRA
version serializes every load and unload of that version, so an unload never races a load of the same name. Order is
always model lock, then version lock. Mutating operations run as owned tasks shielded from the caller's
cancellation: a client that goes away cannot split "loaded everywhere" from "persisted and switched". Every vLLM call
has a timeout taken from the operation's one deadline (`operation_timeout_s`); the last `ROLLBACK_SHARE` of an
activation's budget is kept for its rollback (`lora.operationTimeout` bounds "one multi-instance load + rollback").
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import os
import re
import tempfile
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson

from ..common.policy_names import BASE_POLICY
from .canary import Candidate, in_candidate_arm, parse_candidates, parse_share
from .instances import Instance, InstanceRefused, InstanceRegistry

log = logging.getLogger("openjiuwen.agent_rl.gateway.lora")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
MODELS_PATH = "/v1/models"
ROLLBACK_SHARE = 0.25  # of operation_timeout_s, kept after the loads for unloading a failed activation
STATE_FILE_VERSION = 1
_KEEP: Any = object()  # `_persist`: leave this part of the model's entry as it is

_LORA_NAME_RE = re.compile(r"(?P<model>.+):v(?P<version>[1-9][0-9]*)")
_ALREADY_LOADED = "already been loaded"  # vLLM's 400 text for a repeated load (load_lora_again.txt)

T = TypeVar("T")


def parse_lora_name(name: object) -> tuple[str, int] | None:
    """(model, N) of `<model>:vN`, else None."""
    if not isinstance(name, str):
        return None
    match = _LORA_NAME_RE.fullmatch(name)
    if match is None or not match.group("model").strip():
        return None
    return match.group("model"), int(match.group("version"))


class LoraError(Exception):
    """A refused or failed LoRA operation; routers turn it into the error envelope as it is."""

    def __init__(self, status: int, code: str, message: str = "") -> None:
        super().__init__(f"{status} {code}: {message or code}")
        self.status = status
        self.code = code
        self.message = message or code


@dataclass(frozen=True, slots=True)
class ActiveLora:
    lora_name: str
    lora_path: str

    def public(self) -> dict[str, str]:
        return {"lora_name": self.lora_name, "lora_path": self.lora_path}


class _Load(enum.Enum):
    NEW = "new"  # 2xx: this call loaded it
    ALREADY = "already"  # 400 "already been loaded": it was there
    FAILED = "failed"  # any other answer: not loaded
    UNKNOWN = "unknown"  # timeout or transport error: it may land later
    UNREACHABLE = "unreachable"  # the connection was refused: nothing was sent, the instance is down


@dataclass
class _ModelState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # policy switches of this model
    active: ActiveLora | None = None
    failed: set[str] = field(default_factory=set)  # instances that could not load the active adapter
    artifact_missing: bool = False  # the active adapter's directory is gone or invalid
    candidate: Candidate | None = None  # the canary version beside the active one (docs/rollout.md)


class LoraManager:
    def __init__(
        self,
        registry: InstanceRegistry,
        *,
        lora_root: Path | str,
        state_path: Path | str,
        operation_timeout_s: float,
        client: httpx.AsyncClient | None = None,
        probe: Callable[[Instance], Awaitable[bool]] | None = None,
    ) -> None:
        """`probe`: the health check a registration must pass before the instance serves (None: admit at once)."""
        if not operation_timeout_s > 0:
            raise ValueError("operation_timeout_s must be positive")
        self._registry = registry
        self._root = Path(lora_root)
        self._state_path = Path(state_path)
        self._timeout_s = float(operation_timeout_s)
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(trust_env=False)
        self._models: dict[str, _ModelState] = {}
        self._loaded: defaultdict[str, set[str]] = defaultdict(set)  # instance name → adapters confirmed loaded
        self._stale: defaultdict[str, set[str]] = defaultdict(set)  # instance name → adapters that may be loaded
        self._version_locks: dict[str, asyncio.Lock] = {}
        self._paths: dict[str, str] = {}  # lora name → path, for versions active now or still leased (readmission)
        self._probe = probe
        self._admitting: set[str] = set()  # instances being admitted (a probe round must not start a second one)
        self._leases: Counter[str] = Counter()
        self._inflight: Counter[str] = Counter()  # instance name → requests in flight
        self._turns: dict[str, int] = {}  # round-robin position per routing key
        self._persisted: dict[str, dict[str, str]] = {}  # the state file's content, model → entry
        self._persisted_candidates: dict[str, dict[str, Any]] = {}  # … and its canary candidates, model → entry
        self._file_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # ------------------------------------------------------------------------------------------------ activation

    async def activate(
        self, *, base_model: str, lora_name: str, lora_path: str, expected_lora_name: str
    ) -> dict[str, Any]:
        """CAS-switch the model's active LoRA after loading it on every instance (§3.8). Raises LoraError."""
        return await self._shielded(
            self._activate(base_model, lora_name, lora_path, expected_lora_name), f"lora-activate:{lora_name}"
        )

    async def _activate(self, base_model: Any, lora_name: Any, lora_path: Any, expected: Any) -> dict[str, Any]:
        deadline = self._now() + self._timeout_s
        load_deadline = deadline - self._timeout_s * ROLLBACK_SHARE
        for what, value in (("base_model", base_model), ("lora_name", lora_name), ("lora_path", lora_path),
                            ("expected_lora_name", expected)):
            if not isinstance(value, str):
                raise LoraError(400, "invalid_lora_request", f"{what} must be a string")
        parsed = parse_lora_name(lora_name)
        if parsed is None:
            raise LoraError(400, "invalid_lora_request", "lora_name must be `<model>:v<N>`")
        model = parsed[0]
        problem = await asyncio.to_thread(_artifact_problem, self._root, lora_path)
        if problem is not None:
            raise LoraError(400, "invalid_lora_request", problem)
        self._require_serving(model)
        state = self._state(model)
        wanted = ActiveLora(lora_name, lora_path)
        async with _holding(state.lock, load_deadline) as held:
            if not held:
                raise LoraError(502, "lora_activation_failed", f"another LoRA operation on {model} is still running")
            current = state.active
            if current is not None and current.lora_name == lora_name:
                if os.path.normpath(current.lora_path) == os.path.normpath(lora_path):
                    return _activated(current)  # idempotent, whatever expected_lora_name says
                raise LoraError(409, "lora_cas_conflict", f"{lora_name} is already active from another path")
            if state.candidate is not None:  # one version in flight at a time: the canary decides first
                raise LoraError(409, "canary_conflict",
                                f"{state.candidate.lora_name} is the candidate of {model}: promote or abort it first")
            current_name = current.lora_name if current is not None else BASE_POLICY
            if current_name != expected:
                raise LoraError(409, "lora_cas_conflict", f"active policy is {current_name}, expected {expected}")
            instances = self._require_serving(model)
            async with _holding(self._version_lock(lora_name), load_deadline) as held_version:
                if not held_version:
                    raise LoraError(502, "lora_activation_failed", f"an operation on {lora_name} is still running")
                entry = {"lora_name": lora_name, "lora_path": lora_path, "base_model": base_model,
                         "activated_at": datetime.now(timezone.utc).isoformat()}
                instances = await self._load_everywhere(model, wanted, instances, load_deadline, deadline,
                                                        lambda: self._persist(model, entry))
                # Loaded everywhere and persisted: switch. Nothing awaits between here and the return of the lock.
                self._paths[lora_name] = lora_path
                for instance in instances:
                    self._loaded[instance.name].add(lora_name)
                    self._stale[instance.name].discard(lora_name)
                state.active = wanted
                state.failed.clear()
                state.artifact_missing = False
        log.info("activated %s on %d instance(s) (was %s)", lora_name, len(instances), current_name)
        if current is not None:
            await self._collect_version(current.lora_name, deadline)  # unloads only when not leased
        return _activated(wanted)

    async def _load_everywhere(
        self, model: str, wanted: ActiveLora, instances: list[Instance], load_deadline: float, deadline: float,
        persist: Callable[[], Awaitable[None]],
    ) -> list[Instance]:
        """Load on every serving instance and `persist` the state file; returns the instances that hold it. On any
        failure unload what this call loaded and raise 502. An instance that refuses the connection is down, not
        failed: it leaves routing and the quorum (readmission loads it later) and the activation goes on without it;
        when that leaves no instance, 503 `no_healthy_instances`. Runs under the model lock and the version lock."""
        name = wanted.lora_name
        known = {i.name for i in instances if name in self._loaded[i.name]}
        results = await asyncio.gather(*(self._load(i, wanted, load_deadline) for i in instances))
        for instance, (outcome, detail) in zip(instances, results):
            if outcome is _Load.UNREACHABLE and self._registry.set_serving(instance, False):
                log.warning("instance %s is down (%s): out of routing until it answers again", instance.name, detail)
        reached = [(i, r) for i, r in zip(instances, results) if r[0] is not _Load.UNREACHABLE]
        instances, results = [i for i, _ in reached], [r for _, r in reached]
        failures = [detail for outcome, detail in results if outcome in (_Load.FAILED, _Load.UNKNOWN)]
        if not instances:
            raise LoraError(503, "no_healthy_instances", f"no instance of {model} answered; kept the previous policy")
        if not failures:
            try:
                await persist()
                return instances
            except OSError as exc:
                log.error("could not write the LoRA state file %s", self._state_path, exc_info=exc)
                failures = [f"state file not written: {type(exc).__name__}"]
        # Instances that held it before this call keep it (a leased version stays routable there).
        loaded_here = [(i, outcome is _Load.UNKNOWN) for i, (outcome, _) in zip(instances, results)
                       if outcome is not _Load.FAILED and i.name not in known]
        await self._roll_back(name, loaded_here, deadline)
        log.warning("activation of %s failed, kept the previous policy: %s", name, "; ".join(failures))
        raise LoraError(502, "lora_activation_failed", "; ".join(failures)[:1000])

    async def _roll_back(self, name: str, targets: list[tuple[Instance, bool]], deadline: float) -> None:
        results = await asyncio.gather(*(self._unload(i, name, deadline) for i, _ in targets))
        for (instance, outcome_unknown), gone in zip(targets, results):
            self._loaded[instance.name].discard(name)
            if gone and not outcome_unknown:
                self._stale[instance.name].discard(name)
            else:  # a lost load may still land after our unload: sweep it again later
                self._stale[instance.name].add(name)

    async def deactivate(self, model: str) -> None:
        """New Tasks use base at once (DELETE /v1/loras/{model}); the old version is unloaded unless leased."""
        await self._shielded(self._deactivate(model), f"lora-deactivate:{model}")

    async def _deactivate(self, model: str) -> None:
        state = self._models.get(model)
        if state is None or state.active is None:
            return
        async with state.lock:  # every holder is bounded by its own deadline
            previous = state.active
            if previous is None:
                return
            try:
                await self._persist(model, None)
            except OSError as exc:
                log.error("could not write the LoRA state file %s", self._state_path, exc_info=exc)
                raise LoraError(500, "internal_error", "could not write the LoRA state file") from exc
            state.active = None
            state.failed.clear()
            state.artifact_missing = False
        log.info("deactivated %s; %s serves base", previous.lora_name, model)
        await self._collect_version(previous.lora_name, self._now() + self._timeout_s)

    # ------------------------------------------------------------------------------------------------ canary

    async def start_canary(
        self, *, base_model: str, lora_name: str, lora_path: str, expected_lora_name: str, share: object
    ) -> dict[str, Any]:
        """Load `lora_name` on every instance as the model's candidate beside the active version, which must be
        `expected_lora_name` (CAS, as activation). One candidate per model: another one is 409 `canary_conflict`;
        the same one again is idempotent. Raises LoraError."""
        return await self._shielded(
            self._start_canary(base_model, lora_name, lora_path, expected_lora_name, share),
            f"lora-canary:{lora_name}",
        )

    async def _start_canary(self, base_model: Any, lora_name: Any, lora_path: Any, expected: Any,
                            share: object) -> dict[str, Any]:
        deadline = self._now() + self._timeout_s
        load_deadline = deadline - self._timeout_s * ROLLBACK_SHARE
        model, path = await self._checked_target(base_model, lora_name, lora_path, expected)
        try:
            fraction = parse_share(share)
        except ValueError as exc:
            raise LoraError(400, "invalid_lora_request", str(exc)) from exc
        state = self._state(model)
        async with _holding(state.lock, load_deadline) as held:
            if not held:
                raise LoraError(502, "lora_activation_failed", f"another LoRA operation on {model} is still running")
            current = state.candidate
            if current is not None:
                if current.lora_name == lora_name and os.path.normpath(current.lora_path) == os.path.normpath(path):
                    return self.canary_status(model)  # a repeated start (a lost answer): idempotent
                raise LoraError(409, "canary_conflict", f"{current.lora_name} is already the candidate of {model}")
            active_name = state.active.lora_name if state.active is not None else BASE_POLICY
            if active_name == lora_name:
                raise LoraError(409, "lora_cas_conflict", f"{lora_name} is already active")
            if active_name != expected:
                raise LoraError(409, "lora_cas_conflict", f"active policy is {active_name}, expected {expected}")
            instances = self._require_serving(model)
            wanted = Candidate(lora_name, path, fraction, datetime.now(timezone.utc).isoformat(), base_model)
            async with _holding(self._version_lock(lora_name), load_deadline) as held_version:
                if not held_version:
                    raise LoraError(502, "lora_activation_failed", f"an operation on {lora_name} is still running")
                instances = await self._load_everywhere(
                    model, ActiveLora(lora_name, path), instances, load_deadline, deadline,
                    lambda: self._persist(model, _KEEP, candidate=wanted.entry()),
                )
                # Loaded everywhere and persisted: new Tasks may be pinned to it from here on.
                self._paths[lora_name] = path
                for instance in instances:
                    self._loaded[instance.name].add(lora_name)
                    self._stale[instance.name].discard(lora_name)
                state.candidate = wanted
        log.info("canary %s started on %d instance(s) for %.0f%% of new Tasks (active %s)",
                 lora_name, len(instances), fraction * 100, active_name)
        return self.canary_status(model)

    async def promote_canary(self, *, base_model: str, lora_name: str, expected_lora_name: str) -> dict[str, Any]:
        """Make the candidate `lora_name` the active version, replacing `expected_lora_name` (CAS). Already promoted
        (it is active, no candidate) → idempotent. Raises LoraError 409 `lora_cas_conflict` / `no_canary`."""
        return await self._shielded(self._promote_canary(base_model, lora_name, expected_lora_name),
                                    f"lora-promote:{lora_name}")

    async def _promote_canary(self, base_model: Any, lora_name: Any, expected: Any) -> dict[str, Any]:
        deadline = self._now() + self._timeout_s
        model = self._checked_name(base_model, lora_name, expected)
        state = self._state(model)
        async with _holding(state.lock, deadline) as held:
            if not held:
                raise LoraError(502, "lora_activation_failed", f"another LoRA operation on {model} is still running")
            candidate, previous = state.candidate, state.active
            active_name = previous.lora_name if previous is not None else BASE_POLICY
            if candidate is None:
                if active_name == lora_name:
                    return self.canary_status(model)  # promoted already (a lost answer)
                raise LoraError(409, "no_canary", f"{model} has no candidate")
            if candidate.lora_name != lora_name:
                raise LoraError(409, "lora_cas_conflict", f"the candidate is {candidate.lora_name}, not {lora_name}")
            if active_name != expected:
                raise LoraError(409, "lora_cas_conflict", f"active policy is {active_name}, expected {expected}")
            entry = {"lora_name": candidate.lora_name, "lora_path": candidate.lora_path,
                     "base_model": candidate.base_model or str(base_model),
                     "activated_at": datetime.now(timezone.utc).isoformat()}
            try:
                await self._persist(model, entry, candidate=None)  # one write: active and candidate together
            except OSError as exc:
                log.error("could not write the LoRA state file %s", self._state_path, exc_info=exc)
                raise LoraError(500, "internal_error", "could not write the LoRA state file") from exc
            state.active = ActiveLora(candidate.lora_name, candidate.lora_path)
            state.candidate = None
            state.failed.clear()
            state.artifact_missing = False
        log.info("canary %s promoted (was %s)", lora_name, active_name)
        if self._needs_converge(model):  # an instance that could not load the candidate gets it now
            await self._converge(model, deadline)
        if previous is not None:
            await self._collect_version(previous.lora_name, deadline)  # unloads only when not leased
        return self.canary_status(model)

    async def abort_canary(self, *, base_model: str, lora_name: str) -> dict[str, Any]:
        """Drop the candidate `lora_name`: new Tasks all go to the active version; Tasks pinned to the candidate
        keep it (leases). No candidate, and it is not active → idempotent. Raises LoraError 409."""
        return await self._shielded(self._abort_canary(base_model, lora_name), f"lora-abort:{lora_name}")

    async def _abort_canary(self, base_model: Any, lora_name: Any) -> dict[str, Any]:
        deadline = self._now() + self._timeout_s
        model = self._checked_name(base_model, lora_name, BASE_POLICY)
        state = self._state(model)
        async with _holding(state.lock, deadline) as held:
            if not held:
                raise LoraError(502, "lora_activation_failed", f"another LoRA operation on {model} is still running")
            candidate = state.candidate
            if candidate is None:
                if state.active is not None and state.active.lora_name == lora_name:
                    raise LoraError(409, "lora_cas_conflict", f"{lora_name} was promoted")
                return self.canary_status(model)  # aborted already (a lost answer)
            if candidate.lora_name != lora_name:
                raise LoraError(409, "lora_cas_conflict", f"the candidate is {candidate.lora_name}, not {lora_name}")
            try:
                await self._persist(model, _KEEP, candidate=None)
            except OSError as exc:
                log.error("could not write the LoRA state file %s", self._state_path, exc_info=exc)
                raise LoraError(500, "internal_error", "could not write the LoRA state file") from exc
            state.candidate = None
        log.info("canary %s aborted", lora_name)
        await self._collect_version(lora_name, deadline)  # unloads only when no Task is pinned to it
        return self.canary_status(model)

    def candidate(self, model: str) -> Candidate | None:
        state = self._models.get(model)
        return state.candidate if state is not None else None

    def canary_status(self, model: str) -> dict[str, Any]:
        """`status(model)` with the candidate (null when none) and the lease count per version of the model."""
        leases = {name: n for name, n in sorted(self._leases.items())
                  if n > 0 and (parsed := parse_lora_name(name)) is not None and parsed[0] == model}
        return {**self.status(model), "candidate": self._candidate_row(model), "leases": leases}

    def _candidate_row(self, model: str) -> dict[str, Any] | None:
        candidate = self.candidate(model)
        if candidate is None:
            return None
        ready = sum(1 for i in self._registry.serving(model) if candidate.lora_name in self._loaded[i.name])
        return {**candidate.public(), "instances": {"ready": ready}}

    def _checked_name(self, base_model: Any, lora_name: Any, expected: Any) -> str:
        for what, value in (("base_model", base_model), ("lora_name", lora_name), ("expected_lora_name", expected)):
            if not isinstance(value, str):
                raise LoraError(400, "invalid_lora_request", f"{what} must be a string")
        parsed = parse_lora_name(lora_name)
        if parsed is None:
            raise LoraError(400, "invalid_lora_request", "lora_name must be `<model>:v<N>`")
        return parsed[0]

    async def _checked_target(self, base_model: Any, lora_name: Any, lora_path: Any, expected: Any) -> tuple[str, str]:
        if not isinstance(lora_path, str):
            raise LoraError(400, "invalid_lora_request", "lora_path must be a string")
        model = self._checked_name(base_model, lora_name, expected)
        problem = await asyncio.to_thread(_artifact_problem, self._root, lora_path)
        if problem is not None:
            raise LoraError(400, "invalid_lora_request", problem)
        self._require_serving(model)
        return model, lora_path

    # ------------------------------------------------------------------------------------------------ status

    def active(self, model: str) -> ActiveLora | None:
        state = self._models.get(model)
        return state.active if state is not None else None

    def status(self, model: str) -> dict[str, Any]:
        """The `GET /v1/loras/{model}` body, from what is known now. Counts serving instances only: an unhealthy one
        is outside the quorum, neither ready nor failed."""
        instances = self._registry.serving(model)
        state = self._models.get(model)
        if state is None or state.active is None:
            answer = {"status": BASE_POLICY, "active_lora": None, "instances": {"ready": len(instances), "failed": 0}}
            return self._with_candidate(model, answer)
        name = state.active.lora_name
        ready = sum(1 for i in instances if name in self._loaded[i.name])
        failed = sum(1 for i in instances if i.name in state.failed and name not in self._loaded[i.name])
        status = "degraded" if failed or state.artifact_missing else "active"
        answer = {"status": status, "active_lora": state.active.public(), "instances": {"ready": ready, "failed": failed}}
        return self._with_candidate(model, answer)

    def _with_candidate(self, model: str, answer: dict[str, Any]) -> dict[str, Any]:
        """A canary's candidate is reported beside the active version (the key is absent without one)."""
        row = self._candidate_row(model)
        return {**answer, "candidate": row} if row is not None else answer

    def describe(self, model: str) -> dict[str, Any]:
        """The web console's view of a model: `status(model)`, each instance with the adapters confirmed loaded on it
        and its requests in flight, and the leases (Tasks pinned to a version) of the model's versions."""
        state = self._models.get(model)
        failed = state.failed if state is not None else set()
        instances = [
            {**self._instance_row(i), "failed": i.name in failed} for i in self._registry.for_model(model)
        ]
        leases = {name: n for name, n in sorted(self._leases.items())
                  if n > 0 and (parsed := parse_lora_name(name)) is not None and parsed[0] == model}
        return {**self.status(model), "model": model, "instance_list": instances, "leases": leases}

    def instances(self) -> list[dict[str, Any]]:
        """Every instance with its origin, health and adapters (`GET /aigw/v1/instances`)."""
        return [self._instance_row(i) for i in self._registry.all()]

    def _instance_row(self, i: Instance) -> dict[str, Any]:
        return {"name": i.name, "model": i.model, "address": f"{i.host}:{i.port}",
                "origin": "static" if self._registry.is_static(i.name) else "registered",
                "serving": self._registry.is_serving(i.name), "loaded": sorted(self._loaded.get(i.name, ())),
                "inflight": self._inflight[i.name]}

    async def refresh_status(self, model: str) -> dict[str, Any]:
        """Retry loading the active adapter where it is missing, then `status(model)`."""
        if self._needs_converge(model):
            await self._shielded(self._converge(model, self._now() + self._timeout_s), f"lora-refresh:{model}")
        return self.status(model)

    async def retry_failed(self) -> None:
        """Periodic repair: load the active adapters where they are missing, unload unused versions."""
        await self._shielded(self._retry_all(), "lora-retry")

    async def _retry_all(self) -> None:
        deadline = self._now() + self._timeout_s
        models = set(self._registry.models()) | {m for m, s in self._models.items() if s.active is not None}
        await asyncio.gather(*(self._converge(m, deadline) for m in models if self._needs_converge(m)))
        await asyncio.gather(*(self._load_candidate(m, deadline) for m in models))
        await asyncio.gather(*(self._collect_unused(m, deadline) for m in models))

    async def _load_candidate(self, model: str, deadline: float) -> None:
        """Load the model's candidate where a serving instance lacks it (it failed there, or the instance is new)."""
        candidate = self.candidate(model)
        if candidate is None:
            return
        lacking = [i for i in self._registry.serving(model) if candidate.lora_name not in self._loaded[i.name]]
        await asyncio.gather(*(self._load_leased(i, deadline) for i in lacking))

    # ------------------------------------------------------------------------------------------------ pinning

    def snapshot(self, model: str, *, rl_task_id: str | None = None) -> tuple[str, str]:
        """(policy name, policy model) for a new Task: ("base", model), or (L, L) while L is active or degraded;
        during a canary, (C, C) for the candidate C when the Task id falls in its share. Without a Task id (traffic
        outside a Task): never the candidate."""
        state = self._models.get(model)
        if state is None:
            return BASE_POLICY, model
        candidate = state.candidate
        if candidate is not None and rl_task_id is not None and in_candidate_arm(rl_task_id, candidate.share):
            return candidate.lora_name, candidate.lora_name
        if state.active is None:
            return BASE_POLICY, model
        return state.active.lora_name, state.active.lora_name

    def pin(self, model: str, *, rl_task_id: str | None = None) -> tuple[str, str]:
        """`snapshot` and `acquire` with no await between them."""
        policy_name, policy_model = self.snapshot(model, rl_task_id=rl_task_id)
        self.acquire(policy_name)
        return policy_name, policy_model

    def acquire(self, lora_name: str) -> None:
        """Lease a version so it stays loaded; base (anything not `<model>:vN`) is never leased."""
        if parse_lora_name(lora_name) is not None:
            self._leases[lora_name] += 1

    async def release(self, lora_name: str) -> None:
        """Drop one lease; the last one of a version that is not active unloads it from every instance."""
        if parse_lora_name(lora_name) is None:
            return
        count = self._leases.get(lora_name, 0)
        if count <= 0:
            log.warning("release of %s without a lease", lora_name)
            return
        if count > 1:
            self._leases[lora_name] = count - 1
            return
        del self._leases[lora_name]
        if self._in_use(lora_name) or self._closed:
            return
        await self._shielded(self._collect_version(lora_name, self._now() + self._timeout_s),
                             f"lora-unload:{lora_name}")

    @contextlib.asynccontextmanager
    async def lease(self, lora_name: str) -> AsyncIterator[None]:
        self.acquire(lora_name)  # no await before the try
        try:
            yield
        finally:
            await self.release(lora_name)

    def leases(self) -> dict[str, int]:
        """Lease count per leased version (metrics)."""
        return {name: n for name, n in self._leases.items() if n > 0}

    def lease_count(self, lora_name: str) -> int:
        return self._leases.get(lora_name, 0)

    # ------------------------------------------------------------------------------------------------ routing

    def pick(self, model: str, policy_model: str, *, affinity_key: str | None = None) -> Instance:
        """The instance for one request. A LoRA policy (`<model>:vN`) goes only to instances holding that adapter,
        least in flight then round robin, never by affinity; anything else is base traffic: any instance of the
        model, by rendezvous hash of `affinity_key` when given (prefix-cache locality)."""
        instances = self._require_serving(model)
        parsed = parse_lora_name(policy_model)
        if parsed is None or parsed[0] != model:
            if affinity_key is not None:
                return max(instances, key=lambda i: _rendezvous(affinity_key, i.name))
            return self._least_busy(model, instances)
        holders = [i for i in instances if policy_model in self._loaded[i.name]]
        if not holders:
            raise LoraError(503, "lora_unavailable", f"no instance has {policy_model} loaded")
        return self._least_busy(policy_model, holders)

    def begin(self, instance: Instance) -> None:
        self._inflight[instance.name] += 1

    def end(self, instance: Instance) -> None:
        left = self._inflight[instance.name] - 1
        if left > 0:
            self._inflight[instance.name] = left
        else:
            self._inflight.pop(instance.name, None)

    @contextlib.contextmanager
    def in_flight(self, instance: Instance) -> Iterator[Instance]:
        self.begin(instance)
        try:
            yield instance
        finally:
            self.end(instance)

    def inflight_count(self, instance: Instance) -> int:
        return self._inflight[instance.name]

    def loaded_on(self, instance_name: str) -> frozenset[str]:
        """Adapters confirmed loaded on an instance (what routing uses)."""
        return frozenset(self._loaded.get(instance_name, ()))

    def _least_busy(self, key: str, candidates: list[Instance]) -> Instance:
        low = min(self._inflight[i.name] for i in candidates)
        tied = [i for i in candidates if self._inflight[i.name] == low]
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        return tied[turn % len(tied)]

    # ------------------------------------------------------------------------------------------------ instances

    async def register_instance(self, name: str, model: str, host: str, port: int | str) -> bool:
        """Register an instance, or accept its identical repeat; returns whether it serves now. It must pass the
        health probe, then gets the model's active adapter and the versions still leased before it enters routing; a
        failed load leaves the model `degraded` with this instance serving base only, until a retry succeeds.
        Raises LoraError 400 on bad input, 409 when the name belongs to another instance or the cap is reached."""
        try:
            instance, new = self._registry.register(name, model, host, _port(port))
        except InstanceRefused as exc:
            raise LoraError(exc.status, exc.code, exc.message) from exc
        except (TypeError, ValueError) as exc:
            raise LoraError(400, "invalid_request", f"invalid instance: {exc}") from exc
        if new:
            log.info("instance %s registered for %s at %s", name, model, instance.base_url)
        return await self._shielded(self._admit(instance, probed=False), f"lora-register:{name}")

    async def readmit(self, instance: Instance) -> None:
        """An instance that answers its health probe again: adapters first, then routing (health monitor)."""
        if instance.name in self._admitting:
            return
        await self._shielded(self._admit(instance, probed=True), f"lora-readmit:{instance.name}")

    def remove_instance(self, name: str) -> Instance:
        """Drop a registered instance (operator): out of routing and the quorum at once; requests already sent to it
        finish. Its adapters are left as they are (it may be gone). Raises LoraError 404 / 409 (static)."""
        try:
            instance = self._registry.remove(name)
        except InstanceRefused as exc:
            raise LoraError(exc.status, exc.code, exc.message) from exc
        self._forget(instance)
        log.info("instance %s at %s removed", name, instance.base_url)
        return instance

    async def _admit(self, instance: Instance, *, probed: bool) -> bool:
        self._admitting.add(instance.name)
        try:
            if not probed and self._probe is not None and not await self._probe(instance):
                if self._registry.set_serving(instance, False):
                    log.warning("instance %s at %s does not answer its health check: not serving",
                                instance.name, instance.base_url)
                return False
            handled = await self._adopt(instance)
            if not self._registry.set_serving(instance, True):
                return False  # removed meanwhile
            # An activation that switched after our loads did not include this instance: catch up now that it serves.
            if self.active(instance.model) != handled:
                await self._converge(instance.model, self._now() + self._timeout_s, only={instance.name})
            return True
        finally:
            self._admitting.discard(instance.name)

    async def _adopt(self, instance: Instance) -> ActiveLora | None:
        """Learn what the instance holds, load the active adapter and the leased versions, unload unused ones;
        returns the active version it dealt with."""
        deadline = self._now() + self._timeout_s
        if not await self._sync_loaded(instance, deadline):  # a restarted vLLM re-registers with nothing loaded
            # Holdings unknown: confirm nothing (routing trusts confirmed adapters only); sweep what it may hold.
            self._stale[instance.name] |= self._loaded.pop(instance.name, set())
        state = self._state(instance.model)
        for _ in range(3):  # the active version may switch while we load; catch up, within the deadline
            active = state.active
            if active is None or active.lora_name in self._loaded[instance.name]:
                break
            await self._converge(instance.model, deadline, only={instance.name})
            if state.active == active:
                break  # loaded, or failed (then `retry_failed` and `refresh_status` try again)
        handled = state.active
        await self._load_leased(instance, deadline)
        await self._collect_unused(instance.model, deadline, also=instance)
        return handled

    async def _load_leased(self, instance: Instance, deadline: float) -> None:
        """Load the model's versions that Tasks still hold (pinned) but the instance lacks, so that it can serve
        them again, and the model's canary candidate; a failure only means pinned traffic keeps going to the other
        holders."""
        candidate = self.candidate(instance.model)
        for name in sorted({*self._leases, *([candidate.lora_name] if candidate is not None else [])}):
            path = self._paths.get(name)
            parsed = parse_lora_name(name)
            if path is None or parsed is None or parsed[0] != instance.model or name in self._loaded[instance.name]:
                continue
            async with _holding(self._version_lock(name), deadline) as held:
                if not held or not self._in_use(name) or name in self._loaded[instance.name]:
                    continue
                outcome, detail = await self._load(instance, ActiveLora(name, path), deadline)
                if outcome in (_Load.NEW, _Load.ALREADY):
                    self._loaded[instance.name].add(name)
                    self._stale[instance.name].discard(name)
                else:
                    if outcome is _Load.UNKNOWN:
                        self._stale[instance.name].add(name)
                    log.warning("could not load leased %s: %s", name, detail)

    def _forget(self, instance: Instance) -> None:
        self._loaded.pop(instance.name, None)
        self._stale.pop(instance.name, None)
        for state in self._models.values():
            state.failed.discard(instance.name)

    # ------------------------------------------------------------------------------------------------ restart

    async def restore(self) -> None:
        """At gateway start: read the state file (missing → every model on base) and load each active adapter on
        every instance; a failure or a missing artifact leaves the model explicitly `degraded`. A corrupt state
        file raises LoraError 500 `invalid_lora_state` (the gateway must not guess)."""
        await self._shielded(self._restore(), "lora-restore")

    async def _restore(self) -> None:
        raw = await asyncio.to_thread(_read_bytes, self._state_path)
        entries, candidates = _parse_state(raw) if raw is not None else ({}, {})
        self._persisted = entries
        self._persisted_candidates = {m: c.entry() for m, c in candidates.items()}
        for model, candidate in candidates.items():
            self._state(model).candidate = candidate
            self._paths[candidate.lora_name] = candidate.lora_path
        for model, entry in entries.items():
            state = self._state(model)
            state.active = ActiveLora(entry["lora_name"], entry["lora_path"])
            self._paths[entry["lora_name"]] = entry["lora_path"]
            state.failed.clear()
            state.artifact_missing = False
        deadline = self._now() + self._timeout_s
        await asyncio.gather(*(self._sync_loaded(i, deadline) for m in self._registry.models()
                               for i in self._registry.serving(m)))
        await asyncio.gather(*(self._converge(model, deadline, force_check=True) for model in entries))
        await asyncio.gather(*(self._load_candidate(model, deadline) for model in candidates))
        for model in {*entries, *candidates}:
            log.info("restored %s: %s", model, self.status(model))
        models = set(self._registry.models())
        await asyncio.gather(*(self._collect_unused(m, deadline) for m in models))

    async def close(self) -> None:
        """Cancel and await the operations still running; close the HTTP client when it is ours. Idempotent."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._owns_client:
            await self._client.aclose()

    # ------------------------------------------------------------------------------------------------ internals

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _state(self, model: str) -> _ModelState:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _ModelState()
        return state

    def _version_lock(self, lora_name: str) -> asyncio.Lock:
        lock = self._version_locks.get(lora_name)
        if lock is None:
            lock = self._version_locks[lora_name] = asyncio.Lock()
        return lock

    def _in_use(self, lora_name: str) -> bool:
        """Active for its model, or leased: such a version must stay loaded."""
        if self._leases.get(lora_name, 0) > 0:
            return True
        parsed = parse_lora_name(lora_name)
        active = self.active(parsed[0]) if parsed is not None else None
        candidate = self.candidate(parsed[0]) if parsed is not None else None
        return (active is not None and active.lora_name == lora_name) or (
            candidate is not None and candidate.lora_name == lora_name)

    def _needs_converge(self, model: str) -> bool:
        state = self._models.get(model)
        if state is None or state.active is None:
            return False
        name = state.active.lora_name
        return state.artifact_missing or any(name not in self._loaded[i.name] for i in self._registry.serving(model))

    def _require_serving(self, model: str) -> list[Instance]:
        """The model's serving instances; 503 `no_instances` when it has none at all, 503 `no_healthy_instances`
        when every one is out of routing (unhealthy or not yet admitted)."""
        serving = self._registry.serving(model)
        if serving:
            return serving
        if not self._registry.for_model(model):
            raise LoraError(503, "no_instances", f"no vLLM instance serves {model}")
        raise LoraError(503, "no_healthy_instances", f"no instance of {model} is healthy")

    async def _shielded(self, coro: Coroutine[Any, Any, T], name: str) -> T:
        """Run an operation as an owned task that the caller's cancellation does not interrupt."""
        if self._closed:
            coro.close()
            raise LoraError(503, "gateway_closing", "the LoRA manager is closed")
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _converge(self, model: str, deadline: float, *, only: Iterable[str] | None = None,
                        force_check: bool = False) -> None:
        """Load the active adapter on the model's instances that lack it (all, or those in `only`)."""
        state = self._models.get(model)
        if state is None or state.active is None:
            return
        wanted = state.active
        name = wanted.lora_name
        only_set = set(only) if only is not None else None
        async with _holding(self._version_lock(name), deadline) as held:
            if not held or state.active != wanted:
                return
            # `only` may name an instance being admitted (not serving yet); otherwise the serving ones.
            pool = self._registry.for_model(model) if only_set is not None else self._registry.serving(model)
            targets = [i for i in pool
                       if name not in self._loaded[i.name] and (only_set is None or i.name in only_set)]
            if not targets and not state.artifact_missing and not force_check:
                return
            problem = await asyncio.to_thread(_artifact_problem, self._root, wanted.lora_path)
            if state.active != wanted:
                return
            state.artifact_missing = problem is not None
            if problem is not None:
                state.failed.update(i.name for i in targets)
                log.warning("active %s cannot be loaded on %s: %s", name, [i.name for i in targets], problem)
                return
            if not targets:
                return
            results = await asyncio.gather(*(self._load(i, wanted, deadline) for i in targets))
            still_active = state.active == wanted
            for instance, (outcome, detail) in zip(targets, results):
                if outcome in (_Load.NEW, _Load.ALREADY):
                    self._loaded[instance.name].add(name)
                    self._stale[instance.name].discard(name)
                    if still_active:
                        state.failed.discard(instance.name)
                    continue
                if outcome is _Load.UNKNOWN:
                    self._stale[instance.name].add(name)
                if outcome is _Load.UNREACHABLE and only_set is None:
                    self._registry.set_serving(instance, False)  # down: readmission loads it when it is back
                elif still_active:
                    state.failed.add(instance.name)
                log.warning("could not load %s: %s", name, detail)
        if state.active != wanted:
            await self._collect_version(name, deadline)  # switched meanwhile: what we loaded may be unused

    async def _collect_unused(self, model: str, deadline: float, *, also: Instance | None = None) -> None:
        names: set[str] = set()
        for instance in [*self._registry.serving(model), *([also] if also is not None else [])]:
            names |= self._loaded[instance.name] | self._stale[instance.name]
        await asyncio.gather(*(self._collect_version(n, deadline, also=also) for n in sorted(names)
                               if not self._in_use(n)))

    async def _collect_version(self, name: str, deadline: float, *, also: Instance | None = None) -> None:
        """Unload a version that is neither active nor leased from every serving instance that may hold it (and
        from `also`, an instance being admitted)."""
        async with _holding(self._version_lock(name), deadline) as held:
            if not held:
                log.warning("unload of %s postponed: another operation on it is still running", name)
                return
            if self._in_use(name):
                return
            self._paths.pop(name, None)
            # Out-of-routing instances are skipped (a dead host would hold the unload until the deadline); their
            # readmission lists what they hold and unloads what is unused.
            parsed = parse_lora_name(name)
            pool = self._registry.serving(parsed[0]) if parsed is not None else []
            if also is not None and also not in pool:
                pool.append(also)
            holders = [i for i in pool if name in self._loaded[i.name] or name in self._stale[i.name]]
            for instance in holders:
                self._loaded[instance.name].discard(name)  # no new request goes there from now on
            results = await asyncio.gather(*(self._unload(i, name, deadline) for i in holders))
            for instance, gone in zip(holders, results):
                if gone:
                    self._stale[instance.name].discard(name)
                else:
                    self._stale[instance.name].add(name)
            if holders:
                log.info("unloaded %s from %d instance(s)", name, sum(results))

    async def _call(
        self, method: str, instance: Instance, path: str, body: dict[str, Any] | None, deadline: float
    ) -> httpx.Response:
        remaining = deadline - self._now()
        if remaining <= 0:
            raise TimeoutError("operation deadline passed")
        async with asyncio.timeout_at(deadline):  # httpx's timeout is per phase; this bounds the whole call
            return await self._client.request(method, instance.base_url + path, json=body, timeout=remaining)

    async def _load(self, instance: Instance, lora: ActiveLora, deadline: float) -> tuple[_Load, str]:
        body = {"lora_name": lora.lora_name, "lora_path": lora.lora_path}
        try:
            resp = await self._call("POST", instance, LOAD_PATH, body, deadline)
        except httpx.ConnectError as exc:
            return _Load.UNREACHABLE, f"{instance.name}: connection failed ({type(exc).__name__})"
        except (httpx.HTTPError, TimeoutError) as exc:
            return _Load.UNKNOWN, f"{instance.name}: no answer ({type(exc).__name__})"
        if resp.is_success:
            return _Load.NEW, ""
        if resp.status_code == 400 and _ALREADY_LOADED in resp.text:
            return _Load.ALREADY, ""
        return _Load.FAILED, f"{instance.name}: status {resp.status_code}: {resp.text[:200]}"

    async def _unload(self, instance: Instance, name: str, deadline: float) -> bool:
        """True when the instance no longer holds the adapter (200, or 404 = already gone)."""
        try:
            resp = await self._call("POST", instance, UNLOAD_PATH, {"lora_name": name}, deadline)
        except (httpx.HTTPError, TimeoutError) as exc:
            log.warning("unload of %s on %s got no answer (%s)", name, instance.name, type(exc).__name__)
            return False
        if resp.is_success or resp.status_code == 404:
            return True
        log.warning("unload of %s on %s: status %d: %s", name, instance.name, resp.status_code, resp.text[:200])
        return False

    async def _sync_loaded(self, instance: Instance, deadline: float) -> bool:
        """Learn which of the model's adapters the instance holds (`GET /v1/models`); False on failure, keeping
        what we knew."""
        try:
            resp = await self._call("GET", instance, MODELS_PATH, None, deadline)
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:
            log.warning("could not list the adapters of %s (%s)", instance.name, type(exc).__name__)
            return False
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            log.warning("could not list the adapters of %s (status %d)", instance.name, resp.status_code)
            return False
        held = set()
        for entry in entries:
            model_id = entry.get("id") if isinstance(entry, dict) else None
            parsed = parse_lora_name(model_id)
            if parsed is not None and parsed[0] == instance.model:
                held.add(model_id)
        self._loaded[instance.name] = held
        self._stale.pop(instance.name, None)
        return True

    async def _persist(self, model: str, entry: Any, *, candidate: Any = _KEEP) -> None:
        """Write the whole state file with this model's active entry and / or candidate changed (`_KEEP`: as it
        is; None: removed), in one atomic replace, off the loop."""
        async with self._file_lock:
            models = _changed(self._persisted, model, entry)
            candidates = _changed(self._persisted_candidates, model, candidate)
            document: dict[str, Any] = {"version": STATE_FILE_VERSION, "models": models}
            if candidates:  # absent without a canary: the file stays what an older gateway reads
                document["candidates"] = candidates
            payload = orjson.dumps(document, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
            await asyncio.to_thread(_atomic_write, self._state_path, payload)
            self._persisted, self._persisted_candidates = models, candidates


# ---------------------------------------------------------------------------------------------------- helpers


def _changed(current: dict[str, Any], model: str, value: Any) -> dict[str, Any]:
    out = dict(current)
    if value is None:
        out.pop(model, None)
    elif value is not _KEEP:
        out[model] = value
    return out


def _activated(lora: ActiveLora) -> dict[str, Any]:
    return {"status": "active", "active_lora": lora.public()}


def _port(port: int | str) -> int:
    if isinstance(port, str):
        if not port.strip().isdigit():
            raise ValueError(f"port must be a number, got {port!r}")
        return int(port)
    return port


def _rendezvous(key: str, instance_name: str) -> int:
    """Highest-random-weight hash: a key keeps its instance while others come and go."""
    digest = hashlib.blake2b(f"{key}\x00{instance_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@contextlib.asynccontextmanager
async def _holding(lock: asyncio.Lock, deadline: float) -> AsyncIterator[bool]:
    """Hold `lock` if it can be taken before `deadline`; yields whether it was."""
    acquired = False
    try:
        async with asyncio.timeout_at(deadline):
            await lock.acquire()
        acquired = True
    except TimeoutError:
        pass
    try:
        yield acquired
    finally:
        if acquired:
            lock.release()


def _artifact_problem(root: Path, lora_path: str) -> str | None:
    """Why `lora_path` is not an existing absolute directory inside the LoRA root (symlinks resolved), or None.
    Blocking file system calls: run it in a thread."""
    if not lora_path or "\x00" in lora_path or not os.path.isabs(lora_path):
        return "lora_path must be an absolute path"
    try:
        real_root = root.resolve(strict=True)
    except (OSError, RuntimeError):
        return "the LoRA root does not exist"
    try:
        real = Path(lora_path).resolve(strict=True)
    except (OSError, RuntimeError):
        return "lora_path does not exist"
    if not real.is_dir():
        return "lora_path is not a directory"
    if real == real_root or not real.is_relative_to(real_root):
        return "lora_path is outside the LoRA root"
    return None


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _parse_state(raw: bytes) -> tuple[dict[str, dict[str, str]], dict[str, Candidate]]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise LoraError(500, "invalid_lora_state", "the LoRA state file is not valid JSON") from exc
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise LoraError(500, "invalid_lora_state", "the LoRA state file has no `models` object")
    entries: dict[str, dict[str, str]] = {}
    for model, entry in models.items():
        name = entry.get("lora_name") if isinstance(entry, dict) else None
        path = entry.get("lora_path") if isinstance(entry, dict) else None
        parsed = parse_lora_name(name)
        if parsed is None or parsed[0] != model or not isinstance(path, str):
            raise LoraError(500, "invalid_lora_state", f"invalid LoRA state entry for {model!r}")
        entries[model] = {k: v for k, v in entry.items() if isinstance(v, str)}
    try:
        candidates = parse_candidates(data.get("candidates"), parse_lora_name)
    except ValueError as exc:
        raise LoraError(500, "invalid_lora_state", f"the LoRA state file's candidates: {exc}") from exc
    return entries, candidates


def _atomic_write(path: Path, payload: bytes) -> None:
    """Temp file in the same directory, fsync, rename over the target, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
