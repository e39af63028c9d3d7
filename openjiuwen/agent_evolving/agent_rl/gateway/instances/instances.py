"""The vLLM instances behind the gateway: static ones from the config plus those that register at run time (§3.9).

The registry knows addresses, who owns each name (config or registration) and which instances serve; which adapters
an instance holds is the LoRA manager's business, whether it answers is the health monitor's (health.py). Single event
loop, no locks: every change happens between awaits.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ...common.ids import MAX_INSTANCE_NAME, is_instance_name

# A DNS name (RFC 1123 labels, plus `_`, which container runtimes use in service names); anything else must be an
# IP literal. The host ends up in upstream URLs, so a value no URL can carry (spaces, `/`, `@`, control characters)
# is refused at registration or config load, not when traffic is routed.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")


def valid_host(host: str) -> bool:
    if _HOSTNAME.fullmatch(host):
        return True
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Instance:
    name: str
    model: str  # the served base model name (= the RL `model_id`)
    host: str
    port: int

    def __post_init__(self) -> None:
        for field, value in (("name", self.name), ("model", self.model), ("host", self.host)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"instance {field} must be a non-empty string")
        if not is_instance_name(self.name):
            raise ValueError(f"instance name must be printable and at most {MAX_INSTANCE_NAME} characters")
        if not valid_host(self.host):
            raise ValueError("instance host must be a DNS name or an IP address")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"instance port must be an integer in 1..65535, got {self.port!r}")

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host  # IPv6
        return f"http://{host}:{self.port}"


class InstanceRefused(Exception):
    """A registration or removal the registry refuses, named by its contract code (the LoRA manager re-raises it as
    a LoraError)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InstanceRegistry:
    """Instances by name, in registration order, and which of them serve (healthy and admitted).

    Ownership of a name (issue 19, item 2): a static instance (gateway config) belongs to the config and is never
    replaced or removed at run time; a registered one may only register again as itself (same model and address:
    idempotent), and only an operator removes it. So no holder of the instance key can move an existing name to an
    address of its choosing. At most `max_registered` instances are registered at a time (static ones do not count).

    Serving: static instances start serving; a registered one starts out of routing until it is admitted (probed
    and given the adapters). The health monitor and the LoRA manager flip the flag with `set_serving`.
    """

    def __init__(self, static: Iterable[Instance] = (), *, max_registered: int = 64) -> None:
        if max_registered < 0:
            raise ValueError("max_registered must be >= 0")
        self._by_name: dict[str, Instance] = {}
        self._static: set[str] = set()
        self._serving: set[str] = set()
        self._max_registered = max_registered
        for instance in static:
            if instance.name in self._by_name:
                raise ValueError(f"duplicate instance name {instance.name!r}")
            self._by_name[instance.name] = instance
            self._static.add(instance.name)
            self._serving.add(instance.name)

    def register(self, name: str, model: str, host: str, port: int) -> tuple[Instance, bool]:
        """Add an instance, or accept its identical repeat; returns (the instance, whether it is new).

        Raises ValueError on invalid fields, InstanceRefused 409 `instance_static` / `instance_conflict` when the name
        is taken by a static instance or by a registered one at another address or model, 409
        `instance_limit_reached` when `max_registered` instances are registered already.
        """
        instance = Instance(name, model, host, port)
        existing = self._by_name.get(name)
        if existing is not None:
            if existing == instance:
                return existing, False
            if name in self._static:
                raise InstanceRefused("instance_static",
                                      f"instance {name!r} is configured statically; registration cannot move it")
            raise InstanceRefused("instance_conflict",
                                  f"instance {name!r} is registered at another address or model; an operator must "
                                  "remove it first")
        if self.registered_count() >= self._max_registered:
            raise InstanceRefused("instance_limit_reached",
                                  f"{self._max_registered} instances are registered already "
                                  "(registration.maxInstances); an operator must remove one first")
        self._by_name[name] = instance  # not serving until admitted
        return instance, True

    def remove(self, name: str) -> Instance:
        """Drop a registered instance (operator). Raises InstanceRefused 404 `instance_not_found` or 409
        `instance_static` (static instances change only with the config file and a restart)."""
        instance = self._by_name.get(name)
        if instance is None:
            raise InstanceRefused("instance_not_found", f"no instance named {name!r}")
        if name in self._static:
            raise InstanceRefused("instance_static",
                                  f"instance {name!r} is configured statically; remove it from the config file")
        del self._by_name[name]
        self._serving.discard(name)
        return instance

    def set_serving(self, instance: Instance, serving: bool) -> bool:
        """Put the instance in or out of routing and the activation quorum; False (nothing changed) when the name no
        longer denotes this very instance (removed meanwhile)."""
        if self._by_name.get(instance.name) != instance:
            return False
        if serving:
            self._serving.add(instance.name)
        else:
            self._serving.discard(instance.name)
        return True

    def is_serving(self, name: str) -> bool:
        return name in self._serving

    def is_static(self, name: str) -> bool:
        return name in self._static

    def registered_count(self) -> int:
        return len(self._by_name) - len(self._static)

    @property
    def max_registered(self) -> int:
        return self._max_registered

    def get(self, name: str) -> Instance | None:
        return self._by_name.get(name)

    def for_model(self, model: str) -> list[Instance]:
        """Every instance of the model, serving or not."""
        return [i for i in self._by_name.values() if i.model == model]

    def serving(self, model: str) -> list[Instance]:
        """The model's instances in routing and in the activation quorum."""
        return [i for i in self._by_name.values() if i.model == model and i.name in self._serving]

    def models(self) -> list[str]:
        return list(dict.fromkeys(i.model for i in self._by_name.values()))

    def all(self) -> list[Instance]:
        return list(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Instance]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)
