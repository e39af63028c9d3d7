"""Which instance serves one request (CONTRACT §3.5, docs/gateway.md "Routing"), and the requests in flight per
instance that least-busy routing reads.

A LoRA policy (`<line>:vN`, a version of any line of the model) goes only to instances with that adapter confirmed loaded (holdings.py), least in
flight first, then round robin; never by affinity. A version no instance holds goes to an instance that pages
(adapter_pager.py), which loads it on demand: one whose last on-demand load failed only when no other can
(issue 37 item 4), then least in flight (a request counts from before its page-in, issue 37 item 3), then one with
a free slot, then round robin; one turn counter for every pick, so the first loads of many versions spread over
the instances instead of each version starting at the same one. Anything else is base traffic: any serving instance of the model,
by rendezvous hash of the affinity key when there is one (prefix-cache locality), else least in flight. With
`registration.captureTraffic` off, a captured request (inside an RL Task) goes to static instances only.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Protocol

from ..instances.instances import Instance, InstanceRegistry
from .holdings import Holdings
from .lora_types import LoraError
from .policy_lines import model_of_version


def require_serving(registry: InstanceRegistry, model: str) -> list[Instance]:
    """The model's serving instances; 503 `no_instances` when it has none at all, 503 `no_healthy_instances` when
    every one is out of routing (unhealthy or not yet admitted)."""
    serving = registry.serving(model)
    if serving:
        return serving
    if not registry.for_model(model):
        raise LoraError("no_instances", f"no vLLM instance serves {model}")
    raise LoraError("no_healthy_instances", f"no instance of {model} is healthy")


class Paging(Protocol):
    """What routing asks about on-demand loads (the LoRA manager, over adapter_pager.py)."""

    def can_page(self, instance: Instance, version: str) -> bool: ...

    def free_slots(self, instance: Instance) -> int: ...

    def backed_off(self, instance: Instance) -> bool: ...


class Router:
    def __init__(self, registry: InstanceRegistry, holdings: Holdings, *, capture_registered: bool = True,
                 paging: Paging | None = None) -> None:
        """`capture_registered`: registered instances serve captured traffic too (`registration.captureTraffic`,
        on by default); off, only static ones do, so no holder of the instance key can write training data.
        `paging`: which instances may load a version on demand, and which of them to prefer."""
        self._registry = registry
        self._holdings = holdings
        self._capture_registered = capture_registered
        self._paging = paging
        self._inflight: Counter[str] = Counter()  # instance name → requests in flight
        self._turn = 0  # round-robin position among tied instances, shared by every pick (nothing kept per key)

    def pick(self, model: str, policy_model: str, *, affinity_key: str | None = None,
             captured: bool = False) -> Instance:
        """The instance for one request (`captured`: a request of an RL Task); LoraError 503 when none can serve
        it."""
        instances = require_serving(self._registry, model)
        if captured and not self._capture_registered:
            instances = [i for i in instances if self._registry.is_static(i.name)]
            if not instances:
                raise LoraError("no_capture_instances",
                                f"no static instance of {model} serves; registered instances serve no captured "
                                "traffic (registration.captureTraffic)")
        if model_of_version(policy_model) != model:  # base traffic (a version of any line of the model is not)
            if affinity_key is not None:
                return max(instances, key=lambda i: _rendezvous(affinity_key, i.name))
            return self._least_busy(instances)
        holders = [i for i in instances if self._holdings.holds(i.name, policy_model)]
        if holders:
            return self._least_busy(holders)
        # Paged out everywhere: an instance that pages loads it on demand (the caller's `ensure`).
        paging = self._paging
        pageable = [i for i in instances if paging is not None and paging.can_page(i, policy_model)]
        if paging is None or not pageable:
            raise LoraError("lora_unavailable", f"no instance has {policy_model} loaded")
        healthy = [i for i in pageable if not paging.backed_off(i)] or pageable
        return self._least_busy(healthy, later=lambda i: paging.free_slots(i) == 0)

    @contextlib.contextmanager
    def in_flight(self, instance: Instance) -> Iterator[Instance]:
        """Count one request on `instance` while the block runs."""
        self._inflight[instance.name] += 1
        try:
            yield instance
        finally:
            left = self._inflight[instance.name] - 1
            if left > 0:
                self._inflight[instance.name] = left
            else:
                self._inflight.pop(instance.name, None)

    def in_flight_count(self, instance_name: str) -> int:
        return self._inflight.get(instance_name, 0)

    def forget(self, instance_name: str) -> None:
        """A removed instance: its count goes (requests still in flight there end without recounting it)."""
        self._inflight.pop(instance_name, None)

    def _least_busy(self, candidates: list[Instance], *, later: Callable[[Instance], bool] | None = None) -> Instance:
        """Least in flight; among those, the ones `later` is False for; then the shared turn."""
        def rank(i: Instance) -> tuple[int, bool]:
            return self._inflight[i.name], later(i) if later is not None else False

        low = min(rank(i) for i in candidates)
        tied = [i for i in candidates if rank(i) == low]
        turn, self._turn = self._turn, self._turn + 1
        return tied[turn % len(tied)]


def _rendezvous(key: str, instance_name: str) -> int:
    """Highest-random-weight hash: a key keeps its instance while others come and go."""
    digest = hashlib.blake2b(f"{key}\x00{instance_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
