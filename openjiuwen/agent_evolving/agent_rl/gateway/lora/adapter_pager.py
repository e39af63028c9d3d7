"""Adapter paging (docs/lineages.md "## Gateway", wire 8): each vLLM instance holds at most its LoRA capacity of
adapters; a version a request needs is loaded on demand, after unloading the least recently used adapter that no
request in flight on that instance uses.

`AdapterPager` wraps `AdapterClient` with the same `load` / `unload` / `held` calls, so every load (activation,
canary, repair, on demand) counts against capacity like any other. An instance of capacity 0 is unlimited: calls go
straight through, as before paging existed.

Concurrency (one event loop): `_resident[instance]` is what the instance holds or is loading, least recently used
first; a slot is reserved (the name put there) before the load is sent, so concurrent loads never overfill an
instance. Choosing and unloading a victim happens under the instance's lock; a use (`using`) is counted
with no await between the routing pick and the count, so a version a request was routed to is never the victim.
Requests for the same version on the same instance share one load (single flight).

Tasks come first (issue 37 item 2): requests outside a Task may keep at most `capacity - task_reserved` adapters in
use on an instance (`outside`), so at least `task_reserved` slots hold no adapter such a request uses and a Task's
page-in never waits for traffic outside Tasks. An instance whose on-demand load failed is last in line for page-ins
for a backoff that doubles while it keeps failing (`backed_off`, issue 37 item 4).

A version is no victim while it has users (requests in flight, or a policy switch between its load and the recording
of holdings: `using`) or loads in flight (`_loading` counts them, so two concurrent loads of one version never clear
each other's mark). `unload` (collect, rollback) skips a version with users: the pager's LRU unloads it once idle. A
listing (`held`) is applied only to the names no load, eviction or unload touched since it was requested.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from ..instances.instances import Instance
from .holdings import Holdings
from .lora_locks import holding
from .lora_types import ActiveLora, LoraError
from .vllm_adapters import AdapterClient, Load

log = logging.getLogger("openjiuwen.agent_rl.gateway.lora")


class PagingMetrics(Protocol):
    def adapter_loaded(self, instance: str, seconds: float, lora_name: str) -> None: ...

    def adapter_evicted(self, instance: str) -> None: ...


PAGE_IN_BACKOFF_S = (1.0, 60.0)  # after a failed on-demand load: first backoff, and the most it doubles to


class AdapterPager:
    def __init__(self, vllm: AdapterClient, holdings: Holdings, *, capacity: Callable[[Instance], int],
                 page_timeout_s: float, load_timeout_s: float, metrics: PagingMetrics | None = None,
                 task_reserved: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        """`capacity(instance)`: adapters it may hold (0: unlimited). `page_timeout_s`: how long a load waits for a
        slot; `load_timeout_s`: the bound of an on-demand load itself. `task_reserved`: slots per instance that no
        request outside a Task may keep in use (`lora.taskReservedSlots`)."""
        if not page_timeout_s > 0 or not load_timeout_s > 0:
            raise ValueError("page_timeout_s and load_timeout_s must be positive")
        if task_reserved < 0:
            raise ValueError("task_reserved must not be negative")
        self._vllm = vllm
        self._holdings = holdings
        self._capacity = capacity
        self._page_timeout_s = page_timeout_s
        self._load_timeout_s = load_timeout_s
        self._metrics = metrics
        self._resident: dict[str, OrderedDict[str, None]] = {}
        self._users: Counter[tuple[str, str]] = Counter()  # (instance, version) → requests using it now
        self._loading: Counter[tuple[str, str]] = Counter()  # loads sent and not answered: never a victim
        # Per instance, while a listing is in flight: name → stamp of its last resident change (see `held`).
        self._listings: Counter[str] = Counter()
        self._touched: dict[str, dict[str, int]] = {}
        self._stamp = 0
        self._locks: dict[str, asyncio.Lock] = {}  # per instance: victim choice and slot reservation
        self._changed: dict[str, asyncio.Event] = {}  # per instance: set when a slot or a use went away
        self._on_demand: dict[tuple[str, str], asyncio.Future[tuple[Load, str]]] = {}
        self._task_reserved = task_reserved
        self._outside: Counter[tuple[str, str]] = Counter()  # (instance, version) → requests outside a Task on it
        self._outside_slots: Counter[str] = Counter()  # instance → versions such requests use there now
        self._clock = clock
        self._backoff: dict[str, tuple[float, float]] = {}  # instance → (page-ins last until, current backoff)

    def pages(self, instance: Instance) -> bool:
        return self._capacity(instance) > 0

    def resident(self, instance_name: str) -> list[str]:
        """What the instance holds or is loading, least recently used first."""
        return list(self._resident.get(instance_name, ()))

    def free_slots(self, instance: Instance) -> int:
        """Slots no adapter holds or is loading into (0 on an unlimited instance: it never needs one)."""
        capacity = self._capacity(instance)
        return max(0, capacity - len(self._resident.get(instance.name, ()))) if capacity > 0 else 0

    def backed_off(self, instance: Instance) -> bool:
        """An on-demand load failed there lately: routing sends page-ins elsewhere while it can."""
        entry = self._backoff.get(instance.name)
        return entry is not None and self._clock() < entry[0]

    def forget(self, instance_name: str) -> None:
        """The instance was removed: drop what is kept per instance name (requests still in flight there end as
        usual; their counts are per request and go away with them)."""
        for per_instance in (self._resident, self._locks, self._changed, self._touched, self._backoff,
                             self._listings, self._outside_slots):
            per_instance.pop(instance_name, None)

    def keeps(self, instance: Instance, name: str) -> bool:
        """False when a paging instance no longer holds `name` in its slots (evicted since its load): holdings must
        not record it as loaded there."""
        return not self.pages(instance) or name in self._resident.get(instance.name, ())

    # ------------------------------------------------------------------------------------------ AdapterClient calls

    async def load(self, instance: Instance, lora: ActiveLora, deadline: float) -> tuple[Load, str]:
        """As `AdapterClient.load`; on a paged instance, make room first (waiting at most the page timeout, then
        `Load.NO_ROOM`)."""
        capacity = self._capacity(instance)
        if capacity <= 0:
            return await self._vllm.load(instance, lora, deadline)
        key = (instance.name, lora.lora_name)
        resident = self._resident.setdefault(instance.name, OrderedDict())
        if lora.lora_name not in resident:
            if not await self._reserve(instance, lora.lora_name, capacity, deadline):
                return Load.NO_ROOM, (f"{instance.name}: all {capacity} LoRA slots hold adapters in use "
                                      f"(waited {self._page_timeout_s:g}s)")
        resident.move_to_end(lora.lora_name)
        self._loading[key] += 1
        started = time.perf_counter()
        try:
            outcome, detail = await self._vllm.load(instance, lora, deadline)
        finally:
            self._loading[key] -= 1
            if self._loading[key] <= 0:
                del self._loading[key]
                self._wake(instance.name)  # idle now: a load waiting for room may take its slot
            self._touch(instance.name, lora.lora_name)
        if outcome in (Load.FAILED, Load.UNREACHABLE):
            self._free(instance.name, lora.lora_name)
        elif outcome is Load.NEW and self._metrics is not None:
            self._metrics.adapter_loaded(instance.name, time.perf_counter() - started, lora.lora_name)
        return outcome, detail

    async def unload(self, instance: Instance, name: str, deadline: float) -> bool:
        """As `AdapterClient.unload`. On a paging instance a version with users or a load in flight is not unloaded
        (False: it may still be there): a request routed to it must not meet a 404; it is no longer pinned by its
        line, so the LRU unloads it once idle (or a later sweep does)."""
        if not self.pages(instance):
            return await self._vllm.unload(instance, name, deadline)
        # Under the instance's lock, as an eviction: a load of the same version meanwhile reserves a slot again after
        # this unload, so the two never race at vLLM.
        async with holding(self._locks.setdefault(instance.name, asyncio.Lock()), deadline) as held:
            if not held:
                return False
            if not self._idle(instance.name, name):
                log.info("unload of %s on %s left to paging: requests in flight use it", name, instance.name)
                return False
            resident = self._resident.setdefault(instance.name, OrderedDict())
            was_resident = name in resident
            resident.pop(name, None)
            self._touch(instance.name, name)
            gone = await self._vllm.unload(instance, name, deadline)
            self._touch(instance.name, name)
            if gone:
                self._wake(instance.name)
            elif was_resident:  # it may still be there: it keeps its slot, first in line for eviction
                resident[name] = None
                resident.move_to_end(name, last=False)
            return gone

    async def held(self, instance: Instance, deadline: float) -> set[str] | None:
        """As `AdapterClient.held`, on a paging instance corrected for what changed since the listing was requested:
        a name loaded, evicted or unloaded meanwhile counts as held only when it is resident and no load of it is in
        flight (fail closed: holdings never confirm from a stale listing)."""
        started = self._stamp
        self._listings[instance.name] += 1
        try:
            held = await self._vllm.held(instance, deadline)
        finally:
            self._listings[instance.name] -= 1
            touched = self._touched.get(instance.name, {})
            if self._listings[instance.name] <= 0:
                del self._listings[instance.name]
                self._touched.pop(instance.name, None)
        if held is not None:
            # The listing is the truth for the names nothing changed since it was requested (a load or an eviction
            # that answered meanwhile is newer); loads still in flight keep their reserved slot.
            stale = {n for n, stamp in touched.items() if stamp > started}
            resident = self._resident.setdefault(instance.name, OrderedDict())
            pending = {name for (i, name) in self._loading if i == instance.name}
            for name in [n for n in resident if n not in held and n not in pending and n not in stale]:
                del resident[name]
            for name in sorted(held - set(resident) - stale):
                resident[name] = None
            held = (held - stale) | {n for n in stale if n in resident and n not in pending}
        return held

    async def aclose(self) -> None:
        await self._vllm.aclose()

    # ------------------------------------------------------------------------------------------ on demand

    @contextlib.contextmanager
    def using(self, instance: Instance, name: str, *, outside: bool = False) -> Iterator[None]:
        """Count one request using `name` on `instance`: it is no victim while counted. Enter it right after the
        routing pick (or, `outside` a Task, right after `wait_outside_slot`), with no await in between."""
        key = (instance.name, name)
        self._users[key] += 1
        if outside:
            if self._outside[key] == 0:
                self._outside_slots[instance.name] += 1
            self._outside[key] += 1
        resident = self._resident.get(instance.name)
        if resident is not None and name in resident:
            resident.move_to_end(name)
        try:
            yield
        finally:
            if outside:
                _drop(self._outside, key)
                if key not in self._outside:
                    _drop(self._outside_slots, instance.name)
            if _drop(self._users, key) == 0:
                self._wake(instance.name)

    async def wait_outside_slot(self, instance: Instance, name: str) -> None:
        """Before a request outside a Task uses `name` on a paging instance: wait (at most the page timeout) until
        it may, that is while such requests use fewer than `capacity - task_reserved` versions there or already use
        this one. LoraError 503 `lora_capacity_exhausted` otherwise (at once when no slot is theirs at all)."""
        budget = self._capacity(instance) - self._task_reserved
        if budget <= 0:
            raise LoraError("lora_capacity_exhausted",
                            f"{instance.name}: all its LoRA slots are reserved for RL Tasks (lora.taskReservedSlots)")
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._page_timeout_s
        changed = self._changed.setdefault(instance.name, asyncio.Event())
        while True:
            changed.clear()  # before looking: a release from here on wakes the wait below
            if self._outside[(instance.name, name)] > 0 or self._outside_slots[instance.name] < budget:
                return
            remaining = give_up - loop.time()
            if remaining <= 0:
                raise LoraError("lora_capacity_exhausted",
                                f"{instance.name}: requests outside RL Tasks keep {budget} LoRA slot(s) in use, the "
                                f"most they may (waited {self._page_timeout_s:g}s)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    async def ensure(self, instance: Instance, lora: ActiveLora) -> None:
        """Have `lora` loaded on `instance` for a request counted by `using`; one load per (instance, version) at a
        time. LoraError 503 `lora_capacity_exhausted` when no slot freed within the page timeout, 502
        `lora_load_failed` when the load failed: never served by another adapter."""
        if self._holdings.holds(instance.name, lora.lora_name):
            return
        key = (instance.name, lora.lora_name)
        pending = self._on_demand.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._load_on_demand(instance, lora))
            self._on_demand[key] = pending
            pending.add_done_callback(lambda _: self._on_demand.pop(key, None))
        outcome, detail = await asyncio.shield(pending)  # a cancelled waiter leaves the shared load running
        if outcome.held:
            return
        if outcome is Load.NO_ROOM:
            raise LoraError("lora_capacity_exhausted", detail)
        raise LoraError("lora_load_failed", f"could not load {lora.lora_name}: {detail}"[:1000])

    async def _load_on_demand(self, instance: Instance, lora: ActiveLora) -> tuple[Load, str]:
        deadline = asyncio.get_running_loop().time() + self._page_timeout_s + self._load_timeout_s
        outcome, detail = await self.load(instance, lora, deadline)
        if outcome.held:
            self._holdings.loaded(instance.name, lora.lora_name)
        elif outcome is Load.UNKNOWN:
            self._holdings.uncertain(instance.name, lora.lora_name)  # a late load is swept or confirmed later
        if outcome.held:
            self._backoff.pop(instance.name, None)
        elif outcome is not Load.NO_ROOM:  # it answered with an error, or not at all: others load it for a while
            _, last = self._backoff.get(instance.name, (0.0, 0.0))
            delay = min(PAGE_IN_BACKOFF_S[1], last * 2) if last else PAGE_IN_BACKOFF_S[0]
            self._backoff[instance.name] = (self._clock() + delay, delay)
        if not outcome.held:
            log.warning("on-demand load of %s on %s failed: %s", lora.lora_name, instance.name, detail)
        return outcome, detail

    # ------------------------------------------------------------------------------------------ slots

    async def _reserve(self, instance: Instance, name: str, capacity: int, deadline: float) -> bool:
        """Put `name` in the instance's resident set, unloading idle adapters (least recently used first) or waiting
        for one to become idle, until the page timeout or `deadline`; False when no slot freed."""
        loop = asyncio.get_running_loop()
        give_up = min(deadline, loop.time() + self._page_timeout_s)
        lock = self._locks.setdefault(instance.name, asyncio.Lock())
        changed = self._changed.setdefault(instance.name, asyncio.Event())
        tried: set[str] = set()  # victims whose unload failed this time: not tried again
        while True:
            changed.clear()  # before looking: a release from here on wakes the wait below
            async with lock:  # one victim choice at a time per instance; every holder's unload is bounded
                resident = self._resident.setdefault(instance.name, OrderedDict())
                while name not in resident and len(resident) >= capacity:
                    victim = next((n for n in resident if n not in tried and self._idle(instance.name, n)), None)
                    if victim is None:
                        break
                    if not await self._evict(instance, victim, deadline):
                        tried.add(victim)
                if name in resident or len(resident) < capacity:
                    resident[name] = None
                    self._touch(instance.name, name)
                    return True
            remaining = give_up - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def _idle(self, instance_name: str, name: str) -> bool:
        key = (instance_name, name)
        return self._users.get(key, 0) == 0 and key not in self._loading

    async def _evict(self, instance: Instance, name: str, deadline: float) -> bool:
        """Unload an idle adapter; runs under the instance's lock."""
        self._holdings.unrouted(instance.name, name)  # no new request goes there for it from now on
        # Out of the resident set before the unload is sent: a load of the same version meanwhile must reserve a
        # slot again (it waits for this lock), or it would land beside a slot count that no longer includes it.
        resident = self._resident[instance.name]
        resident.pop(name, None)
        self._touch(instance.name, name)
        gone = await self._vllm.unload(instance, name, deadline)
        self._touch(instance.name, name)
        self._holdings.unloaded(instance.name, name, gone=gone)
        if not gone:  # it may still be there: it keeps its slot, first in line for a later try
            resident[name] = None
            resident.move_to_end(name, last=False)
        else:
            if self._metrics is not None:
                self._metrics.adapter_evicted(instance.name)
            log.info("paged %s out of %s", name, instance.name)
        return gone

    def _touch(self, instance_name: str, name: str) -> None:
        """`name`'s residence on the instance changes now: a listing requested before is stale for it. Recorded only
        while a listing is in flight, so the record stays bounded."""
        if self._listings.get(instance_name, 0) > 0:
            self._stamp += 1
            self._touched.setdefault(instance_name, {})[name] = self._stamp

    def _free(self, instance_name: str, name: str) -> None:
        resident = self._resident.get(instance_name)
        if resident is not None and resident.pop(name, None) is not None:
            self._wake(instance_name)

    def _wake(self, instance_name: str) -> None:
        """A slot or a use went away: loads waiting for room look again."""
        changed = self._changed.get(instance_name)
        if changed is not None:
            changed.set()


def _drop(counts: Counter, key: object) -> int:
    """Count one less of `key`, removing it at zero (the maps stay as small as what is in flight); what is left."""
    left = counts[key] - 1
    if left > 0:
        counts[key] = left
        return left
    counts.pop(key, None)
    return 0
