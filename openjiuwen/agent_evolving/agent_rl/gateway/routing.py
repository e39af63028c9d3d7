"""Which instance serves one request (CONTRACT §3.5, docs/gateway.md "Routing"), and the requests in flight per
instance that least-busy routing reads.

A LoRA policy (`<line>:vN`, a version of any line of the model) goes only to instances with that adapter confirmed loaded (holdings.py), least in
flight first, then round robin; never by affinity. Anything else is base traffic: any serving instance of the model,
by rendezvous hash of the affinity key when there is one (prefix-cache locality), else least in flight. With
`registration.captureTraffic` off, a captured request (inside an RL Task) goes to static instances only.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from collections.abc import Callable, Iterator

from .holdings import Holdings
from .instances import Instance, InstanceRegistry
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


class Router:
    def __init__(self, registry: InstanceRegistry, holdings: Holdings, *, capture_registered: bool = True,
                 can_page: Callable[[Instance, str], bool] | None = None) -> None:
        """`capture_registered`: registered instances serve captured traffic too (`registration.captureTraffic`,
        on by default); off, only static ones do, so no holder of the instance key can write training data.
        `can_page(instance, version)`: the instance may load the version on demand (adapter_pager.py)."""
        self._registry = registry
        self._holdings = holdings
        self._capture_registered = capture_registered
        self._can_page = can_page
        self._inflight: Counter[str] = Counter()  # instance name → requests in flight
        self._turns: dict[str, int] = {}  # round-robin position per routing key

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
            return self._least_busy(model, instances)
        holders = [i for i in instances if self._holdings.holds(i.name, policy_model)]
        if holders:
            return self._least_busy(policy_model, holders)
        # Paged out everywhere: an instance that pages loads it on demand (the caller's `ensure`).
        pageable = [i for i in instances if self._can_page is not None and self._can_page(i, policy_model)]
        if not pageable:
            raise LoraError("lora_unavailable", f"no instance has {policy_model} loaded")
        return self._least_busy(policy_model, pageable)

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

    def _least_busy(self, key: str, candidates: list[Instance]) -> Instance:
        low = min(self._inflight[i.name] for i in candidates)
        tied = [i for i in candidates if self._inflight[i.name] == low]
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        return tied[turn % len(tied)]


def _rendezvous(key: str, instance_name: str) -> int:
    """Highest-random-weight hash: a key keeps its instance while others come and go."""
    digest = hashlib.blake2b(f"{key}\x00{instance_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
