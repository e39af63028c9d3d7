"""Where each LoRA version is loaded, and the repairs that make the instances hold what they must: the active version
of each line on every serving instance (converge), the versions Tasks hold and the canary candidates (load missing),
nothing that is neither (collect). Policy switches (lora_switch.py), admission (instance_admission.py) and the
periodic retry all go through here.

Every vLLM call is bounded by the caller's deadline; every load or unload of a version holds that version's lock.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from ..instances.instances import Instance, InstanceRegistry
from .holdings import Holdings
from .leases import Leases
from .lora_locks import VersionLocks
from .lora_types import ActiveLora
from .policy_lines import PolicyLine, PolicyLines, model_of_version
from .vllm_adapters import AdapterClient, Load

log = logging.getLogger("openjiuwen.agent_rl.gateway.lora")


class Placement:
    def __init__(self, registry: InstanceRegistry, holdings: Holdings, leases: Leases, lines: PolicyLines,
                 vllm: AdapterClient, *, lora_root: Path, pages: Callable[[Instance], bool] = lambda _: False) -> None:
        """`pages(instance)`: the instance pages adapters (adapter_pager.py): its versions are loaded on demand, so
        the repairs here leave it alone (a paged-out active version is no failure)."""
        self._registry = registry
        self._holdings = holdings
        self._leases = leases
        self._lines = lines
        self._vllm = vllm
        self._pages = pages
        self._root = lora_root
        self.locks = VersionLocks()
        self.paths: dict[str, str] = {}  # lora name → path, for versions in use now (readmission loads them)

    async def artifact_problem(self, lora_path: str) -> str | None:
        """Why `lora_path` cannot be loaded (see `_artifact_problem`), or None."""
        return await asyncio.to_thread(_artifact_problem, self._root, lora_path)

    def in_use(self, lora_name: str) -> bool:
        """Leased, or served by its line: such a version must stay loaded."""
        if self._leases.count(lora_name) > 0:
            return True
        line = self._lines.of_version(lora_name)
        return line is not None and line.serves(lora_name)

    def needs_converge(self, line: PolicyLine) -> bool:
        if line.active is None:
            return False
        name = line.active.lora_name
        serving = [i for i in self._registry.serving(line.model) if not self._pages(i)]
        return line.artifact_missing or any(not self._holdings.holds(i.name, name) for i in serving)

    async def converge(self, line: PolicyLine, deadline: float, *, only: Iterable[str] | None = None,
                       force_check: bool = False) -> None:
        """Load the line's active version on its instances that lack it (all serving ones, or those in `only`)."""
        wanted = line.active
        if wanted is None:
            return
        name = wanted.lora_name
        only_set = set(only) if only is not None else None
        async with self.locks.holding(name, deadline) as held:
            if not held or line.active != wanted:
                return
            # `only` may name an instance being admitted (not serving yet); otherwise the serving ones.
            pool = self._registry.for_model(line.model) if only_set is not None else self._registry.serving(line.model)
            targets = [i for i in pool if not self._pages(i)
                       and not self._holdings.holds(i.name, name) and (only_set is None or i.name in only_set)]
            if not targets and not line.artifact_missing and not force_check:
                return
            problem = await self.artifact_problem(wanted.lora_path)
            if line.active != wanted:
                return
            line.artifact_missing = problem is not None
            if problem is not None:
                line.failed.update(i.name for i in targets)
                log.warning("active %s cannot be loaded on %s: %s", name, [i.name for i in targets], problem)
                return
            if not targets:
                return
            results = await asyncio.gather(*(self._vllm.load(i, wanted, deadline) for i in targets))
            still_active = line.active == wanted
            for instance, (outcome, detail) in zip(targets, results):
                if outcome.held:
                    self._holdings.loaded(instance.name, name)
                    if still_active:
                        line.failed.discard(instance.name)
                    continue
                if outcome is Load.UNKNOWN:
                    self._holdings.uncertain(instance.name, name)
                if outcome is Load.UNREACHABLE and only_set is None:
                    self._registry.set_serving(instance, False)  # down: readmission loads it when it is back
                elif still_active:
                    line.failed.add(instance.name)
                log.warning("could not load %s: %s", name, detail)
        if line.active != wanted:
            await self.collect_version(name, deadline)  # switched meanwhile: what we loaded may be unused

    async def load_missing(self, instance: Instance, deadline: float) -> None:
        """Load the versions of the instance's model that Tasks still hold (pinned) and the canary candidates, where
        the instance lacks them; a failure only means that traffic keeps going to the other holders. A paging instance
        loads them on demand instead."""
        if self._pages(instance):
            return
        candidates = {line.candidate.lora_name for line in self._lines
                      if line.model == instance.model and line.candidate is not None}
        for name in sorted({*self._leases.names(), *candidates}):
            path = self.paths.get(name)
            if path is None or model_of_version(name) != instance.model or self._holdings.holds(instance.name, name):
                continue
            async with self.locks.holding(name, deadline) as held:
                if not held or not self.in_use(name) or self._holdings.holds(instance.name, name):
                    continue
                outcome, detail = await self._vllm.load(instance, ActiveLora(name, path), deadline)
                if outcome.held:
                    self._holdings.loaded(instance.name, name)
                else:
                    if outcome is Load.UNKNOWN:
                        self._holdings.uncertain(instance.name, name)
                    log.warning("could not load leased %s: %s", name, detail)

    async def load_candidate(self, line: PolicyLine, deadline: float) -> None:
        """Load the line's candidate where a serving instance lacks it (it failed there, or the instance is new)."""
        candidate = line.candidate
        if candidate is None:
            return
        lacking = [i for i in self._registry.serving(line.model)
                   if not self._pages(i) and not self._holdings.holds(i.name, candidate.lora_name)]
        await asyncio.gather(*(self.load_missing(i, deadline) for i in lacking))

    async def collect_unused(self, model: str, deadline: float, *, also: Instance | None = None) -> None:
        """Unload every version the model's serving instances (and `also`) may hold and nothing uses."""
        names: set[str] = set()
        for instance in [*self._registry.serving(model), *([also] if also is not None else [])]:
            names |= self._holdings.all_names(instance.name)
        await asyncio.gather(*(self.collect_version(n, deadline, also=also) for n in sorted(names)
                               if not self.in_use(n)))

    async def collect_version(self, name: str, deadline: float, *, also: Instance | None = None) -> None:
        """Unload a version that is neither served nor leased from every serving instance that may hold it (and
        from `also`, an instance being admitted)."""
        async with self.locks.holding(name, deadline) as held:
            if not held:
                log.warning("unload of %s postponed: another operation on it is still running", name)
                return
            if self.in_use(name):
                return
            self.paths.pop(name, None)
            # Out-of-routing instances are skipped (a dead host would hold the unload until the deadline); their
            # readmission lists what they hold and unloads what is unused.
            model = model_of_version(name)
            pool = self._registry.serving(model) if model is not None else []
            if also is not None and also not in pool:
                pool.append(also)
            holders = [i for i in pool if self._holdings.may_hold(i.name, name)]
            for instance in holders:
                self._holdings.unrouted(instance.name, name)  # no new request goes there from now on
            results = await asyncio.gather(*(self._vllm.unload(i, name, deadline) for i in holders))
            for instance, gone in zip(holders, results):
                self._holdings.unloaded(instance.name, name, gone=gone)
            if holders:
                log.info("unloaded %s from %d instance(s)", name, sum(results))

    async def sync_loaded(self, instance: Instance, deadline: float) -> bool:
        """Learn which of the model's adapters the instance holds; False on failure, keeping what we knew."""
        held = await self._vllm.held(instance, deadline)
        if held is None:
            return False
        self._holdings.listed(instance.name, held)
        return True

    async def repair(self, deadline: float) -> None:
        """Load the active versions and candidates where they are missing, unload unused versions."""
        models = set(self._registry.models()) | {line.model for line in self._lines if line.active is not None}
        lines = [line for line in self._lines if line.model in models]
        await asyncio.gather(*(self.converge(line, deadline) for line in lines if self.needs_converge(line)))
        await asyncio.gather(*(self.load_candidate(line, deadline) for line in lines))
        await asyncio.gather(*(self.collect_unused(m, deadline) for m in models))


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
