"""Admission of vLLM instances into routing (CONTRACT §3.9): registration, readmission after a health failure, and
removal. An instance serves only once it has what its model's lines serve and the versions Tasks still hold."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ..instances.instance_addresses import AddressPolicy
from ..instances.instances import Instance, InstanceRefused, InstanceRegistry
from .adapter_placement import Placement
from .holdings import Holdings
from .lora_types import ActiveLora, LoraError
from .shielded_operations import ShieldedOperations
from .policy_lines import PolicyLine, PolicyLines

log = logging.getLogger("openjiuwen.agent_rl.gateway.lora")


class Admission:
    def __init__(self, registry: InstanceRegistry, holdings: Holdings, lines: PolicyLines, placement: Placement,
                 operations: ShieldedOperations, *, timeout_s: float, addresses: AddressPolicy,
                 probe: Callable[[Instance], Awaitable[bool]] | None) -> None:
        """`addresses`: what a registration may name. `probe`: the health check a registration must pass before the
        instance serves (None: admit at once)."""
        self._registry = registry
        self._holdings = holdings
        self._lines = lines
        self._placement = placement
        self._operations = operations
        self._timeout_s = timeout_s
        self._addresses = addresses
        self._probe = probe
        self._admitting: set[str] = set()  # instances being admitted (a probe round must not start a second one)

    async def register(self, name: str, model: str, host: str, port: int | str, *,
                       accepted: Callable[[Instance, bool], None] | None = None) -> bool:
        """Register an instance, or accept its identical repeat; returns whether it serves now. Its address must
        pass the address policy (resolved once: the instance is kept at the address checked); it must pass the
        health probe, then gets the model's active adapter and the versions still leased before it enters routing; a
        failed load leaves the model `degraded` with this instance serving base only, until a retry succeeds.
        Raises LoraError 400 on bad input or a refused address, 409 when the name belongs to another instance or
        the cap is reached. `accepted(instance, new)` runs once the registry took the registration (a new name, or
        the identical repeat), before any load: never for a refused one."""
        try:
            if self._registry.is_static(name):  # the config's: a repeat of itself or 409, never the policy
                instance, new = self._registry.register(name, model, host, _port(port))
            else:
                Instance(name, model, host, _port(port))  # a malformed field is 400 before any DNS lookup
                address = await self._addresses.check(host, _port(port))
                instance, new = self._registry.register(name, model, address, _port(port))
        except InstanceRefused as exc:
            raise LoraError(exc.code, exc.message) from exc
        except (TypeError, ValueError) as exc:
            raise LoraError("invalid_request", f"invalid instance: {exc}") from exc
        if accepted is not None:
            accepted(instance, new)
        if new:
            shown = "" if instance.host == host else f" (resolved from {host})"
            log.info("instance %s registered for %s at %s%s", name, model, instance.base_url, shown)
        return await self._operations.run(self._admit(instance, probed=False), f"lora-register:{name}")

    async def readmit(self, instance: Instance) -> None:
        """An instance that answers its health probe again: adapters first, then routing (health monitor)."""
        if instance.name in self._admitting:
            return
        await self._operations.run(self._admit(instance, probed=True), f"lora-readmit:{instance.name}")

    def remove(self, name: str) -> Instance:
        """Drop a registered instance (operator): out of routing and the quorum at once; requests already sent to it
        finish. Its adapters are left as they are (it may be gone). Raises LoraError 404 / 409 (static)."""
        try:
            instance = self._registry.remove(name)
        except InstanceRefused as exc:
            raise LoraError(exc.code, exc.message) from exc
        self._holdings.forget(instance.name)
        for line in self._lines:
            line.failed.discard(instance.name)
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
            # A switch after our loads did not include this instance: catch up now that it serves.
            for line in self._model_lines(instance.model):
                if line.active != handled.get(line.name):
                    await self._placement.converge(line, self._now() + self._timeout_s, only={instance.name})
            return True
        finally:
            self._admitting.discard(instance.name)

    async def _adopt(self, instance: Instance) -> dict[str, ActiveLora | None]:
        """Learn what the instance holds, load the active adapter of each line of its model and the leased versions,
        unload unused ones; returns the active version it dealt with per line."""
        deadline = self._now() + self._timeout_s
        if not await self._placement.sync_loaded(instance, deadline):  # a restarted vLLM re-registers empty
            self._holdings.distrust(instance.name)  # routing trusts confirmed adapters only
        handled: dict[str, ActiveLora | None] = {}
        for line in self._model_lines(instance.model):
            for _ in range(3):  # the active version may switch while we load; catch up, within the deadline
                active = line.active
                if active is None or self._holdings.holds(instance.name, active.lora_name):
                    break
                await self._placement.converge(line, deadline, only={instance.name})
                if line.active == active:
                    break  # loaded, or failed (then the periodic retry and `GET /v1/loras` try again)
            handled[line.name] = line.active
        await self._placement.load_missing(instance, deadline)
        await self._placement.collect_unused(instance.model, deadline, also=instance)
        return handled

    def _model_lines(self, model: str) -> list[PolicyLine]:
        """The default line of `model` (created: its failures are recorded there) and every other line of it."""
        if ":" in model:  # no model id has one (common/validation.py): such an instance serves no line of ours
            return []
        default = self._lines.of(model)
        return [default, *(line for line in self._lines if line.model == model and line is not default)]

    def _now(self) -> float:
        return asyncio.get_running_loop().time()


def _port(port: int | str) -> int:
    if isinstance(port, str):
        if not port.strip().isdigit():
            raise ValueError(f"port must be a number, got {port!r}")
        return int(port)
    return port
