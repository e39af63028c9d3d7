"""The vLLM instances behind the gateway: static ones from the config plus those that register at run time (§3.9).

The registry only knows addresses; which adapters an instance holds is the LoRA manager's business. Single event
loop, no locks: every change happens between awaits.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

# A DNS name (RFC 1123 labels, plus `_`, which container runtimes use in service names); anything else must be an
# IP literal. The host ends up in upstream URLs, so a value no URL can carry (spaces, `/`, `@`, control characters)
# is refused at registration or config load, not when traffic is routed.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")
_MAX_NAME_LENGTH = 256


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
        if len(self.name) > _MAX_NAME_LENGTH or not self.name.isprintable():
            raise ValueError(f"instance name must be printable and at most {_MAX_NAME_LENGTH} characters")
        if not valid_host(self.host):
            raise ValueError("instance host must be a DNS name or an IP address")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"instance port must be an integer in 1..65535, got {self.port!r}")

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host  # IPv6
        return f"http://{host}:{self.port}"


class InstanceRegistry:
    """Instances by name, in registration order. Names are unique; `register` is idempotent by name."""

    def __init__(self, static: Iterable[Instance] = ()) -> None:
        self._by_name: dict[str, Instance] = {}
        for instance in static:
            if instance.name in self._by_name:
                raise ValueError(f"duplicate instance name {instance.name!r}")
            self._by_name[instance.name] = instance

    def register(self, name: str, model: str, host: str, port: int) -> tuple[Instance, Instance | None]:
        """Add or update an instance; returns (the instance now registered, the one it replaced or None).

        A repeat with the same fields changes nothing (the previous one equals the current one); a known name with
        another address or model replaces the old entry, keeping its place in the order. Raises ValueError.
        """
        instance = Instance(name, model, host, port)
        previous = self._by_name.get(name)
        if previous != instance:
            self._by_name[name] = instance
        return instance, previous

    def get(self, name: str) -> Instance | None:
        return self._by_name.get(name)

    def for_model(self, model: str) -> list[Instance]:
        return [i for i in self._by_name.values() if i.model == model]

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
