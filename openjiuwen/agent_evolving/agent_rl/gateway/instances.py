"""The vLLM instances behind the gateway: static ones from the config plus those that register at run time (§3.9).

The registry only knows addresses; which adapters an instance holds is the LoRA manager's business. Single event
loop, no locks: every change happens between awaits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


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
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"instance port must be an integer in 1..65535, got {self.port!r}")

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 literal
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
