"""LoRA lifecycle on the vLLM instances: activation, canary candidates, leases, registration and restart (CONTRACT
§3.3-§3.9). The manager orchestrates; each piece of state it changes has its own module: what each instance holds
(holdings.py), the Tasks pinned per version (leases.py), the state file (lora_state_file.py), vLLM's adapter calls
(vllm_adapters.py); routing.py picks the instance of each request from the holdings.

Concurrency (one event loop): the model lock serializes policy switches (activate, deactivate, canary); a lock per
LoRA version serializes every load and unload of that version, so an unload never races a load of the same name.
Order is always model lock, then version lock. Mutating operations run as owned tasks shielded from the caller's
cancellation: a client that goes away cannot split "loaded everywhere" from "persisted and switched". Every vLLM call
has a timeout taken from the operation's one deadline (`operation_timeout_s`); the last `ROLLBACK_SHARE` of an
activation's budget is kept for its rollback (`lora.operationTimeout` bounds "one multi-instance load + rollback").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import httpx

from .canary import Candidate, in_candidate_arm, parse_share
from .holdings import Holdings
from .instances import Instance, InstanceRefused, InstanceRegistry
from .leases import Leases
from .lora_state_file import KEEP, LoraStateFile
from ..common.ids import model_of, parse_lora_name
from ..common.policy_names import BASE_POLICY
from .lora_types import ActiveLora, LoraError, LoraStatus
from .routing import Router, require_serving
from .vllm_adapters import AdapterClient, Load

log = logging.getLogger("openjiuwen.agent_rl.gateway.lora")

ROLLBACK_SHARE = 0.25  # of operation_timeout_s, kept after the loads for unloading a failed activation

T = TypeVar("T")


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
        self._timeout_s = float(operation_timeout_s)
        self.holdings = Holdings()
        self.routing = Router(registry, self.holdings)  # the inference proxy picks instances and counts requests
        self.leases = Leases()
        self._state_file = LoraStateFile(state_path)
        self._vllm = AdapterClient(client)
        self._models: dict[str, _ModelState] = {}
        self._version_locks: dict[str, asyncio.Lock] = {}
        self._paths: dict[str, str] = {}  # lora name → path, for versions active now or still leased (readmission)
        self._probe = probe
        self._admitting: set[str] = set()  # instances being admitted (a probe round must not start a second one)
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
                raise LoraError("invalid_lora_request", f"{what} must be a string")
        parsed = parse_lora_name(lora_name)
        if parsed is None:
            raise LoraError("invalid_lora_request", "lora_name must be `<model>:v<N>`")
        model = parsed[0]
        problem = await asyncio.to_thread(_artifact_problem, self._root, lora_path)
        if problem is not None:
            raise LoraError("invalid_lora_request", problem)
        require_serving(self._registry, model)
        wanted = ActiveLora(lora_name, lora_path)
        async with self._switching(model, load_deadline) as state:
            current = state.active
            if current is not None and current.lora_name == lora_name:
                if os.path.normpath(current.lora_path) == os.path.normpath(lora_path):
                    return _activated(current)  # idempotent, whatever expected_lora_name says
                raise LoraError("lora_cas_conflict", f"{lora_name} is already active from another path")
            if state.candidate is not None:  # one version in flight at a time: the canary decides first
                raise LoraError("canary_conflict",
                                f"{state.candidate.lora_name} is the candidate of {model}: promote or abort it first")
            current_name = current.lora_name if current is not None else BASE_POLICY
            if current_name != expected:
                raise LoraError("lora_cas_conflict", f"active policy is {current_name}, expected {expected}")
            instances = require_serving(self._registry, model)
            async with self._loading(lora_name, load_deadline):
                entry = {"lora_name": lora_name, "lora_path": lora_path, "base_model": base_model,
                         "activated_at": datetime.now(timezone.utc).isoformat()}
                instances = await self._load_everywhere(model, wanted, instances, load_deadline, deadline,
                                                        lambda: self._state_file.write(model, entry))
                # Loaded everywhere and persisted: switch. Nothing awaits between here and the return of the lock.
                self._paths[lora_name] = lora_path
                for instance in instances:
                    self.holdings.loaded(instance.name, lora_name)
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
        known = {i.name for i in instances if self.holdings.holds(i.name, name)}
        results = await asyncio.gather(*(self._vllm.load(i, wanted, load_deadline) for i in instances))
        for instance, (outcome, detail) in zip(instances, results):
            if outcome is Load.UNREACHABLE and self._registry.set_serving(instance, False):
                log.warning("instance %s is down (%s): out of routing until it answers again", instance.name, detail)
        reached = [(i, r) for i, r in zip(instances, results) if r[0] is not Load.UNREACHABLE]
        instances, results = [i for i, _ in reached], [r for _, r in reached]
        failures = [detail for outcome, detail in results if outcome in (Load.FAILED, Load.UNKNOWN)]
        if not instances:
            raise LoraError("no_healthy_instances", f"no instance of {model} answered; kept the previous policy")
        if not failures:
            try:
                await persist()
                return instances
            except OSError as exc:
                log.error("could not write the LoRA state file %s", self._state_file.path, exc_info=exc)
                failures = [f"state file not written: {type(exc).__name__}"]
        # Instances that held it before this call keep it (a leased version stays routable there).
        loaded_here = [(i, outcome is Load.UNKNOWN) for i, (outcome, _) in zip(instances, results)
                       if outcome is not Load.FAILED and i.name not in known]
        await self._roll_back(name, loaded_here, deadline)
        log.warning("activation of %s failed, kept the previous policy: %s", name, "; ".join(failures))
        raise LoraError("lora_activation_failed", "; ".join(failures)[:1000])

    async def _roll_back(self, name: str, targets: list[tuple[Instance, bool]], deadline: float) -> None:
        results = await asyncio.gather(*(self._vllm.unload(i, name, deadline) for i, _ in targets))
        for (instance, outcome_unknown), gone in zip(targets, results):
            # A lost load may still land after our unload: then it may be there, for a later sweep.
            self.holdings.unloaded(instance.name, name, gone=gone and not outcome_unknown)

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
            await self._write_state(model, None)
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
            raise LoraError("invalid_lora_request", str(exc)) from exc
        async with self._switching(model, load_deadline) as state:
            current = state.candidate
            if current is not None:
                if current.lora_name == lora_name and os.path.normpath(current.lora_path) == os.path.normpath(path):
                    return self.canary_status(model)  # a repeated start (a lost answer): idempotent
                raise LoraError("canary_conflict", f"{current.lora_name} is already the candidate of {model}")
            active_name = state.active.lora_name if state.active is not None else BASE_POLICY
            if active_name == lora_name:
                raise LoraError("lora_cas_conflict", f"{lora_name} is already active")
            if active_name != expected:
                raise LoraError("lora_cas_conflict", f"active policy is {active_name}, expected {expected}")
            instances = require_serving(self._registry, model)
            wanted = Candidate(lora_name, path, fraction, datetime.now(timezone.utc).isoformat(), base_model)
            async with self._loading(lora_name, load_deadline):
                instances = await self._load_everywhere(
                    model, ActiveLora(lora_name, path), instances, load_deadline, deadline,
                    lambda: self._state_file.write(model, KEEP, candidate=wanted.entry()),
                )
                # Loaded everywhere and persisted: new Tasks may be pinned to it from here on.
                self._paths[lora_name] = path
                for instance in instances:
                    self.holdings.loaded(instance.name, lora_name)
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
        async with self._switching(model, deadline) as state:
            candidate, previous = state.candidate, state.active
            active_name = previous.lora_name if previous is not None else BASE_POLICY
            if candidate is None:
                if active_name == lora_name:
                    return self.canary_status(model)  # promoted already (a lost answer)
                raise LoraError("no_canary", f"{model} has no candidate")
            if candidate.lora_name != lora_name:
                raise LoraError("lora_cas_conflict", f"the candidate is {candidate.lora_name}, not {lora_name}")
            if active_name != expected:
                raise LoraError("lora_cas_conflict", f"active policy is {active_name}, expected {expected}")
            entry = {"lora_name": candidate.lora_name, "lora_path": candidate.lora_path,
                     "base_model": candidate.base_model or str(base_model),
                     "activated_at": datetime.now(timezone.utc).isoformat()}
            await self._write_state(model, entry, candidate=None)  # one write: active and candidate together
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
        async with self._switching(model, deadline) as state:
            candidate = state.candidate
            if candidate is None:
                if state.active is not None and state.active.lora_name == lora_name:
                    raise LoraError("lora_cas_conflict", f"{lora_name} was promoted")
                return self.canary_status(model)  # aborted already (a lost answer)
            if candidate.lora_name != lora_name:
                raise LoraError("lora_cas_conflict", f"the candidate is {candidate.lora_name}, not {lora_name}")
            await self._write_state(model, KEEP, candidate=None)
            state.candidate = None
        log.info("canary %s aborted", lora_name)
        await self._collect_version(lora_name, deadline)  # unloads only when no Task is pinned to it
        return self.canary_status(model)

    def candidate(self, model: str) -> Candidate | None:
        state = self._models.get(model)
        return state.candidate if state is not None else None

    def canary_status(self, model: str) -> dict[str, Any]:
        """`status(model)` with the candidate (null when none) and the lease count per version of the model."""
        return {**self.status(model), "candidate": self._candidate_row(model), "leases": self.leases.counts(model)}

    def _candidate_row(self, model: str) -> dict[str, Any] | None:
        candidate = self.candidate(model)
        if candidate is None:
            return None
        ready = sum(1 for i in self._registry.serving(model) if self.holdings.holds(i.name, candidate.lora_name))
        return {**candidate.public(), "instances": {"ready": ready}}

    def _checked_name(self, base_model: Any, lora_name: Any, expected: Any) -> str:
        for what, value in (("base_model", base_model), ("lora_name", lora_name), ("expected_lora_name", expected)):
            if not isinstance(value, str):
                raise LoraError("invalid_lora_request", f"{what} must be a string")
        parsed = parse_lora_name(lora_name)
        if parsed is None:
            raise LoraError("invalid_lora_request", "lora_name must be `<model>:v<N>`")
        return parsed[0]

    async def _checked_target(self, base_model: Any, lora_name: Any, lora_path: Any, expected: Any) -> tuple[str, str]:
        if not isinstance(lora_path, str):
            raise LoraError("invalid_lora_request", "lora_path must be a string")
        model = self._checked_name(base_model, lora_name, expected)
        problem = await asyncio.to_thread(_artifact_problem, self._root, lora_path)
        if problem is not None:
            raise LoraError("invalid_lora_request", problem)
        require_serving(self._registry, model)
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
            answer = {"status": LoraStatus.BASE, "active_lora": None, "instances": {"ready": len(instances), "failed": 0}}
            return self._with_candidate(model, answer)
        name = state.active.lora_name
        ready = sum(1 for i in instances if self.holdings.holds(i.name, name))
        failed = sum(1 for i in instances if i.name in state.failed and not self.holdings.holds(i.name, name))
        status = LoraStatus.DEGRADED if failed or state.artifact_missing else LoraStatus.ACTIVE
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
        return {**self.status(model), "model": model, "instance_list": instances, "leases": self.leases.counts(model)}

    def instances(self) -> list[dict[str, Any]]:
        """Every instance with its origin, health and adapters (`GET /aigw/v1/instances`)."""
        return [self._instance_row(i) for i in self._registry.all()]

    def _instance_row(self, i: Instance) -> dict[str, Any]:
        return {"name": i.name, "model": i.model, "address": f"{i.host}:{i.port}",
                "origin": "static" if self._registry.is_static(i.name) else "registered",
                "serving": self._registry.is_serving(i.name), "loaded": sorted(self.holdings.confirmed(i.name)),
                "inflight": self.routing.in_flight_count(i.name)}

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
        lacking = [i for i in self._registry.serving(model) if not self.holdings.holds(i.name, candidate.lora_name)]
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

    def acquire(self, lora_name: str) -> None:
        """Lease a version so it stays loaded (a Task pinned to it); base is never leased."""
        self.leases.acquire(lora_name)

    async def release(self, lora_name: str) -> None:
        """Drop one lease; the last one of a version that is not active unloads it from every instance."""
        if not self.leases.drop(lora_name) or self._in_use(lora_name) or self._closed:
            return
        await self._shielded(self._collect_version(lora_name, self._now() + self._timeout_s),
                             f"lora-unload:{lora_name}")

    # ------------------------------------------------------------------------------------------------ instances

    async def register_instance(self, name: str, model: str, host: str, port: int | str) -> bool:
        """Register an instance, or accept its identical repeat; returns whether it serves now. It must pass the
        health probe, then gets the model's active adapter and the versions still leased before it enters routing; a
        failed load leaves the model `degraded` with this instance serving base only, until a retry succeeds.
        Raises LoraError 400 on bad input, 409 when the name belongs to another instance or the cap is reached."""
        try:
            instance, new = self._registry.register(name, model, host, _port(port))
        except InstanceRefused as exc:
            raise LoraError(exc.code, exc.message) from exc
        except (TypeError, ValueError) as exc:
            raise LoraError("invalid_request", f"invalid instance: {exc}") from exc
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
            raise LoraError(exc.code, exc.message) from exc
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
            self.holdings.distrust(instance.name)  # routing trusts confirmed adapters only
        state = self._state(instance.model)
        for _ in range(3):  # the active version may switch while we load; catch up, within the deadline
            active = state.active
            if active is None or self.holdings.holds(instance.name, active.lora_name):
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
        for name in sorted({*self.leases.names(), *([candidate.lora_name] if candidate is not None else [])}):
            path = self._paths.get(name)
            if path is None or model_of(name) != instance.model or self.holdings.holds(instance.name, name):
                continue
            async with _holding(self._version_lock(name), deadline) as held:
                if not held or not self._in_use(name) or self.holdings.holds(instance.name, name):
                    continue
                outcome, detail = await self._vllm.load(instance, ActiveLora(name, path), deadline)
                if outcome.held:
                    self.holdings.loaded(instance.name, name)
                else:
                    if outcome is Load.UNKNOWN:
                        self.holdings.uncertain(instance.name, name)
                    log.warning("could not load leased %s: %s", name, detail)

    def _forget(self, instance: Instance) -> None:
        self.holdings.forget(instance.name)
        for state in self._models.values():
            state.failed.discard(instance.name)

    # ------------------------------------------------------------------------------------------------ restart

    async def restore(self) -> None:
        """At gateway start: read the state file (missing → every model on base) and load each active adapter on
        every instance; a failure or a missing artifact leaves the model explicitly `degraded`. A corrupt state
        file raises LoraError 500 `invalid_lora_state` (the gateway must not guess)."""
        await self._shielded(self._restore(), "lora-restore")

    async def _restore(self) -> None:
        entries, candidates = await self._state_file.read()
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
        await self._vllm.aclose()

    # ------------------------------------------------------------------------------------------------ internals

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _state(self, model: str) -> _ModelState:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _ModelState()
        return state

    @contextlib.asynccontextmanager
    async def _switching(self, model: str, deadline: float) -> AsyncIterator[_ModelState]:
        """Hold the model's lock for a policy switch; 502 when another operation holds it past `deadline`."""
        state = self._state(model)
        async with _holding(state.lock, deadline) as held:
            if not held:
                raise LoraError("lora_activation_failed", f"another LoRA operation on {model} is still running")
            yield state

    @contextlib.asynccontextmanager
    async def _loading(self, lora_name: str, deadline: float) -> AsyncIterator[None]:
        """Hold a version's lock to load it as active or candidate; 502 when it is busy past `deadline`."""
        async with _holding(self._version_lock(lora_name), deadline) as held:
            if not held:
                raise LoraError("lora_activation_failed", f"an operation on {lora_name} is still running")
            yield

    def _version_lock(self, lora_name: str) -> asyncio.Lock:
        lock = self._version_locks.get(lora_name)
        if lock is None:
            lock = self._version_locks[lora_name] = asyncio.Lock()
        return lock

    def _in_use(self, lora_name: str) -> bool:
        """Active for its model, or leased: such a version must stay loaded."""
        if self.leases.count(lora_name) > 0:
            return True
        model = model_of(lora_name)
        active = self.active(model) if model is not None else None
        candidate = self.candidate(model) if model is not None else None
        return (active is not None and active.lora_name == lora_name) or (
            candidate is not None and candidate.lora_name == lora_name)

    def _needs_converge(self, model: str) -> bool:
        state = self._models.get(model)
        if state is None or state.active is None:
            return False
        name = state.active.lora_name
        serving = self._registry.serving(model)
        return state.artifact_missing or any(not self.holdings.holds(i.name, name) for i in serving)

    async def _shielded(self, coro: Coroutine[Any, Any, T], name: str) -> T:
        """Run an operation as an owned task that the caller's cancellation does not interrupt."""
        if self._closed:
            coro.close()
            raise LoraError("gateway_closing", "the LoRA manager is closed")
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
                       if not self.holdings.holds(i.name, name) and (only_set is None or i.name in only_set)]
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
            results = await asyncio.gather(*(self._vllm.load(i, wanted, deadline) for i in targets))
            still_active = state.active == wanted
            for instance, (outcome, detail) in zip(targets, results):
                if outcome.held:
                    self.holdings.loaded(instance.name, name)
                    if still_active:
                        state.failed.discard(instance.name)
                    continue
                if outcome is Load.UNKNOWN:
                    self.holdings.uncertain(instance.name, name)
                if outcome is Load.UNREACHABLE and only_set is None:
                    self._registry.set_serving(instance, False)  # down: readmission loads it when it is back
                elif still_active:
                    state.failed.add(instance.name)
                log.warning("could not load %s: %s", name, detail)
        if state.active != wanted:
            await self._collect_version(name, deadline)  # switched meanwhile: what we loaded may be unused

    async def _collect_unused(self, model: str, deadline: float, *, also: Instance | None = None) -> None:
        names: set[str] = set()
        for instance in [*self._registry.serving(model), *([also] if also is not None else [])]:
            names |= self.holdings.all_names(instance.name)
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
            model = model_of(name)
            pool = self._registry.serving(model) if model is not None else []
            if also is not None and also not in pool:
                pool.append(also)
            holders = [i for i in pool if self.holdings.may_hold(i.name, name)]
            for instance in holders:
                self.holdings.unrouted(instance.name, name)  # no new request goes there from now on
            results = await asyncio.gather(*(self._vllm.unload(i, name, deadline) for i in holders))
            for instance, gone in zip(holders, results):
                self.holdings.unloaded(instance.name, name, gone=gone)
            if holders:
                log.info("unloaded %s from %d instance(s)", name, sum(results))

    async def _sync_loaded(self, instance: Instance, deadline: float) -> bool:
        """Learn which of the model's adapters the instance holds; False on failure, keeping what we knew."""
        held = await self._vllm.held(instance, deadline)
        if held is None:
            return False
        self.holdings.listed(instance.name, held)
        return True

    async def _write_state(self, model: str, entry: Any, *, candidate: Any = KEEP) -> None:
        """`LoraStateFile.write` for an operation that cannot go on without it: LoraError 500 on failure."""
        try:
            await self._state_file.write(model, entry, candidate=candidate)
        except OSError as exc:
            log.error("could not write the LoRA state file %s", self._state_file.path, exc_info=exc)
            raise LoraError("internal_error", "could not write the LoRA state file") from exc


# ---------------------------------------------------------------------------------------------------- helpers


def _activated(lora: ActiveLora) -> dict[str, Any]:
    return {"status": LoraStatus.ACTIVE, "active_lora": lora.public()}


def _port(port: int | str) -> int:
    if isinstance(port, str):
        if not port.strip().isdigit():
            raise ValueError(f"port must be a number, got {port!r}")
        return int(port)
    return port


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
