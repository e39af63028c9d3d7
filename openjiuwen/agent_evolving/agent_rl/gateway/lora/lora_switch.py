"""The one routine that switches what a policy line serves (CONTRACT §3.8): activation, deactivation and every canary
step are a `Switch` decided under the line's lock, carried out here the same way.

A switch loads its target on every serving instance (`load`; all-or-nothing among the static instances: on a failure
there what this switch loaded is unloaded again and 502; a registered instance that fails is left out of routing for
that version instead, issue 28 item 1), persists the state file, changes the line in memory with no await in between, and then,
outside the lock, loads a new active version where it is missing (a promoted candidate) and unloads every version
the line no longer serves, unless Tasks still hold it (leases). The last `ROLLBACK_SHARE` of the deadline is kept
for the rollback, so `lora.operationTimeout` bounds "one multi-instance load + rollback".

Paging instances (adapter_pager.py): the loaded version stays pinned in the pager (a use per instance) from before its
load until holdings record it, so no other line's page-in evicts it in between; holdings record it only where the
pager still holds it. There the load is best effort: `Load.NO_ROOM` (every slot in use) is no failure, the version is
paged in when a Task needs it; a refused load still fails the switch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..instances.instances import Instance, InstanceRegistry
from .adapter_pager import AdapterPager
from .adapter_placement import Placement
from .canary import Candidate
from .holdings import Holdings
from .lora_locks import holding
from .lora_state_file import KEEP, LoraStateFile
from .lora_types import ActiveLora, LoraError
from .policy_lines import PolicyLine, PolicyLines
from .routing import require_serving
from .vllm_adapters import Load

log = logging.getLogger("openjiuwen.agent_rl.gateway.lora")

ROLLBACK_SHARE = 0.25  # of the operation timeout, kept after the loads for unloading a failed switch


@dataclass(frozen=True, slots=True)
class Serving:
    """What a line serves."""

    active: ActiveLora | None
    candidate: Candidate | None

    def versions(self) -> set[str]:
        return {lora.lora_name for lora in (self.active, self.candidate) if lora is not None}


@dataclass(frozen=True, slots=True)
class Switch:
    """A line's next `Serving`, decided under its lock. `load`: the version to load everywhere first. `active_entry`:
    the state file's new entry for the active version (`KEEP` when the active version stays). `note`: for the log."""

    to: Serving
    note: str
    load: ActiveLora | None = None
    active_entry: Any = KEEP


class Switcher:
    def __init__(self, registry: InstanceRegistry, holdings: Holdings, lines: PolicyLines, placement: Placement,
                 state_file: LoraStateFile, vllm: AdapterPager, *, timeout_s: float) -> None:
        self._registry = registry
        self._holdings = holdings
        self._lines = lines
        self._placement = placement
        self._state_file = state_file
        self._vllm = vllm
        self._timeout_s = timeout_s

    def load_deadline(self, deadline: float) -> float:
        """The end of the loads of an operation ending at `deadline` (the rest is for its rollback)."""
        return deadline - self._timeout_s * ROLLBACK_SHARE

    async def switch(self, line_name: str, decide: Callable[[PolicyLine], Switch | None], *, deadline: float | None,
                     wait_until: float | None) -> Serving:
        """Hold the line's lock (until `wait_until`, else 502; None: as long as it takes, every holder being
        bounded), `decide` (None: nothing to do, e.g. a repeated request; it raises LoraError to refuse), carry the
        switch out within `deadline` (None: one operation timeout from taking the lock); returns what the line
        serves when the lock is released."""
        line = self._lines.of(line_name)
        async with self._holding(line, wait_until):
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self._timeout_s
            change = decide(line)
            before = Serving(line.active, line.candidate)
            if change is None:
                return before
            with contextlib.ExitStack() as pins:  # the version's pager uses, released once holdings record it
                holders, excused = await self._load_and_persist(line, change, deadline, pins)
                # Loaded everywhere and persisted: switch. Nothing awaits between here and the release of the lock.
                if change.load is not None:
                    self._placement.paths[change.load.lora_name] = change.load.lora_path
                    for instance in holders:
                        if self._vllm.keeps(instance, change.load.lora_name):  # fail closed: never route to a gap
                            self._holdings.loaded(instance.name, change.load.lora_name)
            if change.to.active != line.active:
                line.failed.clear()
                line.artifact_missing = False
            if change.load is not None and change.load == change.to.active:
                line.failed.update(i.name for i in excused)  # `degraded` until a retry loads it there
            line.active, line.candidate = change.to.active, change.to.candidate
        loaded = f" on {len(holders)} instance(s)" if change.load is not None else ""
        log.info("%s%s", change.note, loaded)
        after = change.to
        if after.active is not None and after.active not in (before.active, change.load) \
                and self._placement.needs_converge(line):
            await self._placement.converge(line, deadline)  # a promoted candidate that failed somewhere
        for name in sorted(before.versions() - after.versions()):
            await self._placement.collect_version(name, deadline)  # unloads only when not leased
        return after

    @contextlib.asynccontextmanager
    async def _holding(self, line: PolicyLine, wait_until: float | None) -> AsyncIterator[None]:
        if wait_until is None:
            async with line.lock:
                yield
            return
        async with holding(line.lock, wait_until) as held:
            if not held:
                raise LoraError("lora_activation_failed", f"another LoRA operation on {line.name} is still running")
            yield

    async def _load_and_persist(self, line: PolicyLine, change: Switch, deadline: float,
                                pins: contextlib.ExitStack) -> tuple[list[Instance], list[Instance]]:
        """Load `change.load` everywhere (when set) and write the state file; returns the instances that hold it and
        the registered ones that could not load it."""
        before = line.candidate
        candidate_entry = KEEP if change.to.candidate == before else (
            change.to.candidate.entry() if change.to.candidate is not None else None)

        async def persist() -> None:
            await self._state_file.write(line.name, change.active_entry, candidate=candidate_entry)

        if change.load is None:
            try:
                await persist()
            except OSError as exc:
                log.error("could not write the LoRA state file %s", self._state_file.path, exc_info=exc)
                raise LoraError("internal_error", "could not write the LoRA state file") from exc
            return [], []
        load_deadline = self.load_deadline(deadline)
        instances = require_serving(self._registry, line.model)
        async with self._placement.locks.loading(change.load.lora_name, load_deadline):
            return await self._load_everywhere(line.model, change.load, instances, load_deadline, deadline, persist,
                                               pins)

    async def _load_everywhere(
        self, model: str, wanted: ActiveLora, instances: list[Instance], load_deadline: float, deadline: float,
        persist: Callable[[], Awaitable[None]], pins: contextlib.ExitStack,
    ) -> tuple[list[Instance], list[Instance]]:
        """Load on every serving instance and `persist` the state file; returns (the instances that hold it, the
        registered instances that could not load it). A static instance that fails fails the switch: what this call
        loaded is unloaded again, 502. A registered instance that fails (an error, no answer in time) stays out of
        routing for this version only, so that no holder of the instance key can block a switch; when no instance
        holds it at the end, the switch fails the same way. An instance that refuses the connection is down: it
        leaves routing and the quorum (readmission loads it later) and the switch goes on without it; when that
        leaves no instance, 503 `no_healthy_instances`. A paging instance with no free slot (`NO_ROOM`) is neither
        holder nor failure. `pins`: a pager use per instance, entered here and left to the caller (closed before a
        rollback, which must not be skipped as "in use"). Runs under the line lock and the version lock."""
        name = wanted.lora_name
        known = {i.name for i in instances if self._holdings.holds(i.name, name)}
        for instance in instances:
            pins.enter_context(self._vllm.using(instance, name))
        results = await asyncio.gather(*(self._vllm.load(i, wanted, load_deadline) for i in instances))
        for instance, (outcome, detail) in zip(instances, results):
            if outcome is Load.UNREACHABLE and self._registry.set_serving(instance, False):
                log.warning("instance %s is down (%s): out of routing until it answers again", instance.name, detail)
        reached = [(i, r) for i, r in zip(instances, results) if r[0] is not Load.UNREACHABLE]
        instances, results = [i for i, _ in reached], [r for _, r in reached]
        if not instances:
            raise LoraError("no_healthy_instances", f"no instance of {model} answered; kept the previous policy")
        holders = [i for i, (outcome, _) in zip(instances, results) if outcome.held]
        # NO_ROOM comes only from a paging instance: it pages the version in on demand, so it is no failure there.
        failed = [(i, outcome, detail) for i, (outcome, detail) in zip(instances, results)
                  if not outcome.held and outcome is not Load.NO_ROOM]
        for instance, (outcome, detail) in zip(instances, results):
            if outcome is Load.NO_ROOM:
                log.info("%s not loaded on %s now (%s): paged in when a Task needs it", name, instance.name, detail)
        failures = [detail for i, _, detail in failed if self._registry.is_static(i.name) or not holders]
        excused = [] if failures else [i for i, _, _ in failed]
        if not failures:
            try:
                await persist()
            except OSError as exc:
                log.error("could not write the LoRA state file %s", self._state_file.path, exc_info=exc)
                failures = [f"state file not written: {type(exc).__name__}"]
            else:
                for instance, outcome, detail in failed:
                    if outcome is Load.UNKNOWN:
                        self._holdings.uncertain(instance.name, name)  # a late load is swept or confirmed later
                    log.warning("registered instance %s could not load %s (%s): out of routing for it until a "
                                "retry loads it", instance.name, name, detail)
                return holders, excused
        # Instances that held it before this call keep it (a leased version stays routable there).
        loaded_here = [(i, outcome is Load.UNKNOWN) for i, (outcome, _) in zip(instances, results)
                       if outcome not in (Load.FAILED, Load.NO_ROOM) and i.name not in known]
        pins.close()  # the rollback unloads it: no longer a use of ours
        await self._roll_back(name, loaded_here, deadline)
        log.warning("activation of %s failed, kept the previous policy: %s", name, "; ".join(failures))
        raise LoraError("lora_activation_failed", "; ".join(failures)[:1000])

    async def _roll_back(self, name: str, targets: list[tuple[Instance, bool]], deadline: float) -> None:
        results = await asyncio.gather(*(self._vllm.unload(i, name, deadline) for i, _ in targets))
        for (instance, outcome_unknown), gone in zip(targets, results):
            # A lost load may still land after our unload: then it may be there, for a later sweep.
            self._holdings.unloaded(instance.name, name, gone=gone and not outcome_unknown)
