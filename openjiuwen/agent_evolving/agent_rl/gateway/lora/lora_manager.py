"""LoRA lifecycle on the vLLM instances (CONTRACT §3.3-§3.9): the operations the gateway's routes, Task pinning and
health checks call, over one module per concern.

- policy_lines.py: what each line serves (active version, canary candidate) and the one lookup of a line;
- line_switches.py: the decision of each switch (argument checks, compare-and-swap on the expected version) under
  the line's lock; lora_switch.py: the one switch routine behind activate, deactivate and the canary steps;
- adapter_placement.py: which instance holds which version, and the repairs (converge, load missing, collect);
- instance_admission.py: registration, readmission and removal of instances;
- lora_views.py: the status bodies; holdings.py, leases.py, routing.py, lora_state_file.py, vllm_adapters.py: the
  state each of those changes, and vLLM's adapter calls.

Concurrency (one event loop): a line's lock serializes its switches; a lock per version serializes every load and
unload of that version (lora_locks.py). Mutating operations run as asyncio tasks shielded from the caller's
cancellation (shielded_operations.py). Every vLLM call has a timeout taken from the operation's one deadline
(`operation_timeout_s`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, ContextManager, Protocol

import httpx

from ...common.lineage import parse_version_name
from ...common.policy_names import BASE_POLICY
from ..instances.instance_addresses import AddressPolicy
from ..instances.instances import Instance, InstanceRegistry
from .adapter_pager import AdapterPager, PagingMetrics
from .adapter_placement import Placement
from .canary import Candidate, in_candidate_arm
from .holdings import Holdings
from .instance_admission import Admission
from .leases import Leases
from .line_switches import LineSwitches
from .lora_state_file import LoraStateFile
from .lora_switch import Serving, Switcher
from .lora_types import ActiveLora, LoraError
from .lora_views import LoraViews
from .shielded_operations import ShieldedOperations
from .policy_lines import PolicyLines, line_of_version, model_of_line
from .routing import Router
from .vllm_adapters import AdapterClient

__all__ = ["LoraError", "LoraManager"]

log = logging.getLogger("openjiuwen.agent_rl.gateway.lora")


class UseHolder(Protocol):
    """What holds an adapter's use until a request ends: the request's call (proxy/captured_call.py), or an
    ExitStack."""

    def enter_context(self, cm: ContextManager[Any]) -> Any: ...


class LoraManager:
    def __init__(
        self,
        registry: InstanceRegistry,
        *,
        lora_root: Path | str,
        state_path: Path | str,
        operation_timeout_s: float,
        addresses: AddressPolicy,
        capture_registered: bool = True,
        client: httpx.AsyncClient | None = None,
        probe: Callable[[Instance], Awaitable[bool]] | None = None,
        max_loras: Mapping[str, int] | None = None,
        max_loras_default: int = 0,
        page_timeout_s: float = 30.0,
        paging_metrics: PagingMetrics | None = None,
        task_reserved_slots: int = 1,
        max_leased_versions: int = 4,
    ) -> None:
        """`addresses`: what a registration may name (instances/instance_addresses.py). `capture_registered`: registered
        instances serve captured traffic too (routing.py). `probe`: the health check a registration must pass before
        the instance serves (None: admit at once). `max_loras`: LoRA capacity per instance name (static instances'
        `maxLoras`), else `max_loras_default`; 0 is unlimited (adapter_pager.py). `task_reserved_slots`: slots of a
        paging instance that requests outside a Task never keep in use (`lora.taskReservedSlots`).
        `max_leased_versions`: versions of a line that Tasks may keep loaded besides what the line serves
        (`lora.maxLeasedVersionsPerLine`, `leased_past_cap`)."""
        if not operation_timeout_s > 0:
            raise ValueError("operation_timeout_s must be positive")
        self._registry = registry
        self._timeout_s = float(operation_timeout_s)
        self.holdings = Holdings()
        self._max_loras = dict(max_loras or {})  # instance name → capacity (registrations add theirs)
        self._max_loras_default = max_loras_default
        self.pager = AdapterPager(AdapterClient(client), self.holdings, capacity=self._capacity,
                                  page_timeout_s=page_timeout_s, load_timeout_s=self._timeout_s,
                                  metrics=paging_metrics, task_reserved=task_reserved_slots)
        self._vllm = self.pager  # every load counts against capacity
        # The inference proxy picks instances and counts requests.
        self.routing = Router(registry, self.holdings, capture_registered=capture_registered, paging=self)
        self.leases = Leases()
        self._max_leased_versions = max_leased_versions
        self._lines = PolicyLines()
        self._state_file = LoraStateFile(state_path)
        self._operations = ShieldedOperations()
        self._placement = Placement(registry, self.holdings, self.leases, self._lines, self._vllm,
                                    lora_root=Path(lora_root), pages=self.pager.pages)
        self._switcher = Switcher(registry, self.holdings, self._lines, self._placement, self._state_file,
                                  self._vllm, timeout_s=self._timeout_s)
        self._admission = Admission(registry, self.holdings, self._lines, self._placement, self._operations,
                                    timeout_s=self._timeout_s, addresses=addresses, probe=probe)
        self._views = LoraViews(registry, self.holdings, self.leases, self._lines, self.routing)
        self._switches = LineSwitches(registry, self._lines, self._placement, self._switcher, self._views,
                                      timeout_s=self._timeout_s)

    # ------------------------------------------------------------------------------------------------ activation

    async def activate(
        self, *, base_model: str, lora_name: str, lora_path: str, expected_lora_name: str
    ) -> dict[str, Any]:
        """CAS-switch the model's active LoRA after loading it on every instance (§3.8). Raises LoraError."""
        return await self._operations.run(
            self._switches.activate(base_model, lora_name, lora_path, expected_lora_name), f"lora-activate:{lora_name}"
        )

    async def deactivate(self, model: str) -> None:
        """New Tasks of the line `model` use base at once (DELETE /v1/loras/{line}); the old version is unloaded
        unless leased."""
        await self._operations.run(self._switches.deactivate(model), f"lora-deactivate:{model}")

    async def retire(self, line_name: str) -> dict[str, Any]:
        """A lineage archived or deleted (docs/lineages.md "Lifecycle"): its line stops serving its candidate and its
        active version in one switch (one state-file write: the line's entries go), and each is unloaded where no
        Task holds it (a leased one once its last Task ends). Idempotent: a line that serves nothing answers the
        same. New Tasks of the line are pinned to base; outside a Task its versions are no longer accepted."""
        line = self._lines.get(line_name)
        before = sorted(Serving(line.active, line.candidate).versions()) if line is not None else []
        if before:
            await self._operations.run(self._switches.retire(line_name), f"lora-retire:{line_name}")
        return {"status": "retired", "line": line_name, "versions": before}

    # ------------------------------------------------------------------------------------------------ canary

    async def start_canary(
        self, *, base_model: str, lora_name: str, lora_path: str, expected_lora_name: str, share: object
    ) -> dict[str, Any]:
        """Load `lora_name` on every instance as the model's candidate beside the active version, which must be
        `expected_lora_name` (CAS, as activation). One candidate per model: another one is 409 `canary_conflict`;
        the same one again is idempotent. Raises LoraError."""
        return await self._operations.run(
            self._switches.start_canary(base_model, lora_name, lora_path, expected_lora_name, share),
            f"lora-canary:{lora_name}",
        )

    async def promote_canary(self, *, base_model: str, lora_name: str, expected_lora_name: str) -> dict[str, Any]:
        """Make the candidate `lora_name` the active version, replacing `expected_lora_name` (CAS). Already promoted
        (it is active, no candidate) → idempotent. Raises LoraError 409 `lora_cas_conflict` / `no_canary`."""
        return await self._operations.run(self._switches.promote_canary(base_model, lora_name, expected_lora_name),
                                          f"lora-promote:{lora_name}")

    async def abort_canary(self, *, base_model: str, lora_name: str) -> dict[str, Any]:
        """Drop the candidate `lora_name`: new Tasks all go to the active version; Tasks pinned to the candidate
        keep it (leases). No candidate, and it is not active → idempotent. Raises LoraError 409."""
        return await self._operations.run(self._switches.abort_canary(base_model, lora_name),
                                          f"lora-abort:{lora_name}")

    def candidate(self, model: str) -> Candidate | None:
        line = self._lines.get(model)
        return line.candidate if line is not None else None

    # ------------------------------------------------------------------------------------------------ status

    def active(self, model: str) -> ActiveLora | None:
        line = self._lines.get(model)
        return line.active if line is not None else None

    def status(self, model: str) -> dict[str, Any]:
        return self._views.status(model)

    def canary_status(self, model: str) -> dict[str, Any]:
        return self._views.canary_status(model)

    def describe(self, model: str) -> dict[str, Any]:
        return self._views.describe(model)

    def instances(self) -> list[dict[str, Any]]:
        return self._views.instances()

    async def refresh_status(self, model: str) -> dict[str, Any]:
        """Retry loading the active adapter where it is missing, then `status(model)`."""
        line = self._lines.get(model)
        if line is not None and self._placement.needs_converge(line):
            await self._operations.run(self._placement.converge(line, self._now() + self._timeout_s),
                                  f"lora-refresh:{model}")
        return self.status(model)

    async def retry_failed(self) -> None:
        """Periodic repair: load the active adapters and candidates where they are missing, unload unused versions."""
        await self._operations.run(self._placement.repair(self._now() + self._timeout_s), "lora-retry")

    # ------------------------------------------------------------------------------------------------ pinning

    def snapshot(self, line_name: str, *, rl_task_id: str | None = None) -> tuple[str, str]:
        """(policy name, policy model) for a new Task of a line: ("base", model), or (L, L) while L is active or
        degraded; during a canary, (C, C) for the candidate C when the Task id falls in its share. Without a Task id
        (traffic outside a Task): never the candidate."""
        model = model_of_line(line_name)
        line = self._lines.get(line_name)
        if line is None:
            return BASE_POLICY, model
        candidate = line.candidate
        if candidate is not None and rl_task_id is not None and in_candidate_arm(rl_task_id, candidate.share):
            return candidate.lora_name, candidate.lora_name
        if line.active is None:
            return BASE_POLICY, model
        return line.active.lora_name, line.active.lora_name

    async def page_in(self, instance: Instance, policy_model: str, counts: UseHolder, *, task: bool = True) -> None:
        """Before a request for `policy_model` goes to `instance` (the routing pick, no await since): on a paging
        instance, count the use in `counts` (the request's call, proxy/captured_call.py; so the adapter is no victim
        until the request ends) and load the version on demand. A request outside a Task (`task` False) first waits for
        a slot of those not reserved for Tasks (adapter_pager.py). LoraError 503 `lora_capacity_exhausted` / 502
        `lora_load_failed` / 503 `lora_unavailable`."""
        if not self.pager.pages(instance) or line_of_version(policy_model) is None:
            return
        if not task:
            await self.pager.wait_outside_slot(instance, policy_model)
        counts.enter_context(self.pager.using(instance, policy_model, outside=not task))  # no await before it
        if self.holdings.holds(instance.name, policy_model):
            return
        path = self._placement.paths.get(policy_model)
        if path is None:  # neither served nor leased: nothing to load it from
            raise LoraError("lora_unavailable", f"no instance has {policy_model} loaded")
        await self.pager.ensure(instance, ActiveLora(policy_model, path))

    def _capacity(self, instance: Instance) -> int:
        return self._max_loras.get(instance.name, self._max_loras_default)

    # Paging, as routing asks it (routing.Paging).

    def can_page(self, instance: Instance, version: str) -> bool:
        return self._capacity(instance) > 0 and version in self._placement.paths

    def free_slots(self, instance: Instance) -> int:
        return self.pager.free_slots(instance)

    def backed_off(self, instance: Instance) -> bool:
        return self.pager.backed_off(instance)

    def leased_past_cap(self, line_name: str | None = None) -> list[str]:
        """The versions whose Tasks should end, oldest first: of each line (or of `line_name`), every version Tasks
        hold that the line no longer serves, but its newest `max_leased_versions`. A static instance keeps every
        leased version loaded, so without a cap one key holding a Task per version would fill vLLM's slots and
        fail other lines' activations (issue 37, "leases on non-paging instances")."""
        by_line: dict[str, list[tuple[int, str]]] = {}
        for name in self.leases.names():
            parsed = parse_version_name(name)
            if parsed is None or (line_name is not None and parsed[0] != line_name):
                continue
            line = self._lines.get(parsed[0])
            if line is None or not line.serves(name):
                by_line.setdefault(parsed[0], []).append((parsed[1], name))
        past: list[str] = []
        for versions in by_line.values():
            versions.sort()
            past += [name for _, name in versions[:max(0, len(versions) - self._max_leased_versions)]]
        return past

    def acquire(self, lora_name: str) -> None:
        """Lease a version so it stays loaded (a Task pinned to it); base is never leased."""
        self.leases.acquire(lora_name)

    async def release(self, lora_name: str) -> None:
        """Drop one lease; the last one of a version that is not active unloads it from every instance."""
        if not self.leases.drop(lora_name) or self._placement.in_use(lora_name) or self._operations.closed:
            return
        await self._operations.run(self._placement.collect_version(lora_name, self._now() + self._timeout_s),
                              f"lora-unload:{lora_name}")

    # ------------------------------------------------------------------------------------------------ instances

    async def register_instance(self, name: str, model: str, host: str, port: int | str, *,
                                max_loras: int | None = None) -> bool:
        """See `Admission.register`: whether the instance serves now. `max_loras`: its LoRA capacity (None: the
        gateway default; a static instance keeps its configured one). Raises LoraError 400 / 409.

        The capacity is stored only when the registry admits a new name, before its loads (they count against it):
        a refused registration (another address: 409 `instance_conflict`) never touches the capacity of the
        instance it named, and a repeat keeps the capacity its name was admitted with (issue 37 item 5; an
        operator removes the instance to change it)."""

        def accepted(instance: Instance, new: bool) -> None:
            if max_loras is None or self._registry.is_static(instance.name):
                return
            if new:
                self._max_loras[instance.name] = max_loras
            elif self._capacity(instance) != max_loras:
                log.warning("instance %s repeated its registration with maxLoras %d: it keeps %d (remove it to "
                            "change its capacity)", instance.name, max_loras, self._capacity(instance))

        return await self._admission.register(name, model, host, port, accepted=accepted)

    async def readmit(self, instance: Instance) -> None:
        """An instance that answers its health probe again: adapters first, then routing (health monitor)."""
        await self._admission.readmit(instance)

    def remove_instance(self, name: str) -> Instance:
        """Drop a registered instance (operator), and everything kept per instance name. Raises LoraError 404 / 409
        (static)."""
        instance = self._admission.remove(name)
        self._max_loras.pop(name, None)  # a later registration under the name states its own
        self.pager.forget(name)
        self.routing.forget(name)
        return instance

    # ------------------------------------------------------------------------------------------------ restart

    async def restore(self) -> None:
        """At gateway start: read the state file (missing → every line on base) and load each active adapter on
        every instance; a failure or a missing artifact leaves the model explicitly `degraded`. A corrupt state
        file raises LoraError 500 `invalid_lora_state` (the gateway must not guess)."""
        await self._operations.run(self._restore(), "lora-restore")

    async def _restore(self) -> None:
        entries, candidates = await self._state_file.read()
        for model, candidate in candidates.items():
            self._lines.of(model).candidate = candidate
            self._placement.paths[candidate.lora_name] = candidate.lora_path
        for model, entry in entries.items():
            line = self._lines.of(model)
            line.active = ActiveLora(entry["lora_name"], entry["lora_path"])
            self._placement.paths[entry["lora_name"]] = entry["lora_path"]
            line.failed.clear()
            line.artifact_missing = False
        deadline = self._now() + self._timeout_s
        placement = self._placement
        await asyncio.gather(*(placement.sync_loaded(i, deadline) for m in self._registry.models()
                               for i in self._registry.serving(m)))
        await asyncio.gather(*(placement.converge(self._lines.of(m), deadline, force_check=True) for m in entries))
        await asyncio.gather(*(placement.load_candidate(self._lines.of(m), deadline) for m in candidates))
        for model in {*entries, *candidates}:
            log.info("restored %s: %s", model, self.status(model))
        await asyncio.gather(*(placement.collect_unused(m, deadline) for m in set(self._registry.models())))

    async def close(self) -> None:
        """Cancel and await the operations still running; close the HTTP client when it is ours. Idempotent."""
        if self._operations.closed:
            return
        await self._operations.close()
        await self._vllm.aclose()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

