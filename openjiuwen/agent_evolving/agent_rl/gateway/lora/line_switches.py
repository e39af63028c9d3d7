"""The decision of each policy switch of a line (CONTRACT §3.8, docs/rollout.md): activate, deactivate, retire, and
the canary's start, promotion and abort. Each checks its arguments, then decides the switch under the line's lock
(compare-and-swap on the expected version; a repeat of a switch already made is idempotent) and hands it to the one
switch routine (lora_switch.py). The LoRA manager (lora_manager.py) runs each as a shielded operation."""

from __future__ import annotations

import asyncio
import os
from datetime import datetime, timezone
from typing import Any

from ...common.lineage import parse_version_name
from ...common.policy_names import BASE_POLICY
from ..instances.instances import InstanceRegistry
from .adapter_placement import Placement
from .canary import Candidate, parse_share
from .lora_switch import Serving, Switch, Switcher
from .lora_types import ActiveLora, LoraError, LoraStatus
from .lora_views import LoraViews
from .policy_lines import PolicyLine, PolicyLines, model_of_line
from .routing import require_serving


class LineSwitches:
    def __init__(self, registry: InstanceRegistry, lines: PolicyLines, placement: Placement, switcher: Switcher,
                 views: LoraViews, *, timeout_s: float) -> None:
        self._registry = registry
        self._lines = lines
        self._placement = placement
        self._switcher = switcher
        self._views = views
        self._timeout_s = timeout_s

    async def activate(self, base_model: Any, lora_name: Any, lora_path: Any, expected: Any) -> dict[str, Any]:
        deadline = self._now() + self._timeout_s
        model, path = await self._checked_target(base_model, lora_name, lora_path, expected)
        wanted = ActiveLora(lora_name, path)

        def decide(line: PolicyLine) -> Switch | None:
            current = line.active
            if current is not None and current.lora_name == lora_name:
                if os.path.normpath(current.lora_path) == os.path.normpath(path):
                    return None  # idempotent, whatever expected_lora_name says
                raise LoraError("lora_cas_conflict", f"{lora_name} is already active from another path")
            if line.candidate is not None:  # one version in flight at a time: the canary decides first
                raise LoraError("canary_conflict",
                                f"{line.candidate.lora_name} is the candidate of {model}: promote or abort it first")
            current_name = current.lora_name if current is not None else BASE_POLICY
            if current_name != expected:
                raise LoraError("lora_cas_conflict", f"active policy is {current_name}, expected {expected}")
            entry = {"lora_name": lora_name, "lora_path": path, "base_model": base_model,
                     "activated_at": datetime.now(timezone.utc).isoformat()}
            return Switch(Serving(wanted, None), f"activated {lora_name} (was {current_name})", load=wanted,
                          active_entry=entry)

        serving = await self._switcher.switch(model, decide, deadline=deadline,
                                              wait_until=self._switcher.load_deadline(deadline))
        active = serving.active or wanted  # `wanted`, or the same version stored by an earlier request
        return {"status": LoraStatus.ACTIVE, "active_lora": active.public()}

    async def deactivate(self, model: str) -> None:
        line = self._lines.get(model)
        if line is None or line.active is None:
            return

        def decide(line: PolicyLine) -> Switch | None:
            if line.active is None:
                return None
            return Switch(Serving(None, line.candidate), f"deactivated {line.active.lora_name}; {model} serves base",
                          active_entry=None)

        await self._switcher.switch(model, decide, deadline=None, wait_until=None)  # every holder is bounded

    async def retire(self, model: str) -> None:
        def decide(line: PolicyLine) -> Switch | None:
            if line.active is None and line.candidate is None:
                return None
            return Switch(Serving(None, None), f"retired {model}: it serves nothing now", active_entry=None)

        await self._switcher.switch(model, decide, deadline=None, wait_until=None)  # every holder is bounded

    async def start_canary(self, base_model: Any, lora_name: Any, lora_path: Any, expected: Any,
                            share: object) -> dict[str, Any]:
        deadline = self._now() + self._timeout_s
        model, path = await self._checked_target(base_model, lora_name, lora_path, expected)
        try:
            fraction = parse_share(share)
        except ValueError as exc:
            raise LoraError("invalid_lora_request", str(exc)) from exc

        def decide(line: PolicyLine) -> Switch | None:
            current = line.candidate
            if current is not None:
                if current.lora_name == lora_name and os.path.normpath(current.lora_path) == os.path.normpath(path):
                    return None  # a repeated start (a lost answer): idempotent
                raise LoraError("canary_conflict", f"{current.lora_name} is already the candidate of {model}")
            active_name = line.active.lora_name if line.active is not None else BASE_POLICY
            if active_name == lora_name:
                raise LoraError("lora_cas_conflict", f"{lora_name} is already active")
            if active_name != expected:
                raise LoraError("lora_cas_conflict", f"active policy is {active_name}, expected {expected}")
            wanted = Candidate(lora_name, path, fraction, datetime.now(timezone.utc).isoformat(), base_model)
            return Switch(Serving(line.active, wanted),
                          f"canary {lora_name} started for {fraction * 100:.0f}% of new Tasks (active {active_name})",
                          load=ActiveLora(lora_name, path))

        await self._switcher.switch(model, decide, deadline=deadline, wait_until=self._switcher.load_deadline(deadline))
        return self._views.canary_status(model)

    async def promote_canary(self, base_model: Any, lora_name: Any, expected: Any) -> dict[str, Any]:
        deadline = self._now() + self._timeout_s
        model = _checked_name(base_model, lora_name, expected)

        def decide(line: PolicyLine) -> Switch | None:
            candidate = line.candidate
            active_name = line.active.lora_name if line.active is not None else BASE_POLICY
            if candidate is None:
                if active_name == lora_name:
                    return None  # promoted already (a lost answer)
                raise LoraError("no_canary", f"{model} has no candidate")
            if candidate.lora_name != lora_name:
                raise LoraError("lora_cas_conflict", f"the candidate is {candidate.lora_name}, not {lora_name}")
            if active_name != expected:
                raise LoraError("lora_cas_conflict", f"active policy is {active_name}, expected {expected}")
            entry = {"lora_name": candidate.lora_name, "lora_path": candidate.lora_path,
                     "base_model": candidate.base_model or str(base_model),
                     "activated_at": datetime.now(timezone.utc).isoformat()}
            # One state-file write: active and candidate together.
            return Switch(Serving(ActiveLora(candidate.lora_name, candidate.lora_path), None),
                          f"canary {lora_name} promoted (was {active_name})", active_entry=entry)

        await self._switcher.switch(model, decide, deadline=deadline, wait_until=deadline)
        return self._views.canary_status(model)

    async def abort_canary(self, base_model: Any, lora_name: Any) -> dict[str, Any]:
        deadline = self._now() + self._timeout_s
        model = _checked_name(base_model, lora_name, BASE_POLICY)

        def decide(line: PolicyLine) -> Switch | None:
            candidate = line.candidate
            if candidate is None:
                if line.active is not None and line.active.lora_name == lora_name:
                    raise LoraError("lora_cas_conflict", f"{lora_name} was promoted")
                return None  # aborted already (a lost answer)
            if candidate.lora_name != lora_name:
                raise LoraError("lora_cas_conflict", f"the candidate is {candidate.lora_name}, not {lora_name}")
            return Switch(Serving(line.active, None), f"canary {lora_name} aborted")

        await self._switcher.switch(model, decide, deadline=deadline, wait_until=deadline)
        return self._views.canary_status(model)

    async def _checked_target(self, base_model: Any, lora_name: Any, lora_path: Any, expected: Any) -> tuple[str, str]:
        """(model, path) of a version to load; 400 on a bad name or path, 503 when no instance can take it."""
        if not isinstance(lora_path, str):
            raise LoraError("invalid_lora_request", "lora_path must be a string")
        model = _checked_name(base_model, lora_name, expected)
        problem = await self._placement.artifact_problem(lora_path)
        if problem is not None:
            raise LoraError("invalid_lora_request", problem)
        require_serving(self._registry, model_of_line(model))
        return model, lora_path

    def _now(self) -> float:
        return asyncio.get_running_loop().time()


def _checked_name(base_model: Any, lora_name: Any, expected: Any) -> str:
    """The line of `lora_name` (docs/lineages.md); 400 unless every argument is a string and the name is
    `<line>:v<N>`. (`base_model` is the base model's path on the wire; the routes check the line's model.)"""
    for what, value in (("base_model", base_model), ("lora_name", lora_name), ("expected_lora_name", expected)):
        if not isinstance(value, str):
            raise LoraError("invalid_lora_request", f"{what} must be a string")
    parsed = parse_version_name(lora_name)
    if parsed is None:
        raise LoraError("invalid_lora_request", "lora_name must be `<line>:v<N>`")
    return parsed[0]
