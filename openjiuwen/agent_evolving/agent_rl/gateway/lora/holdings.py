"""Which LoRA adapters each vLLM instance holds, as far as the gateway knows.

*Confirmed*: a load answered 200 or "already been loaded", or `GET /v1/models` listed it; routing trusts only these,
so a request never reaches an instance lacking its adapter. *Maybe*: an answer was lost (a load that may land later,
an unload that may not have happened), so a later sweep unloads it again; 404 on unload means gone.
"""

from __future__ import annotations

from collections import defaultdict


class Holdings:
    def __init__(self) -> None:
        self._confirmed: defaultdict[str, set[str]] = defaultdict(set)  # instance name → adapters
        self._maybe: defaultdict[str, set[str]] = defaultdict(set)  # instance name → adapters

    def confirmed(self, instance: str) -> frozenset[str]:
        return frozenset(self._confirmed.get(instance, ()))

    def holds(self, instance: str, lora_name: str) -> bool:
        """Confirmed loaded: the only knowledge routing acts on."""
        return lora_name in self._confirmed.get(instance, ())

    def may_hold(self, instance: str, lora_name: str) -> bool:
        return self.holds(instance, lora_name) or lora_name in self._maybe.get(instance, ())

    def all_names(self, instance: str) -> set[str]:
        """Every adapter the instance holds or may hold."""
        return set(self._confirmed.get(instance, ())) | self._maybe.get(instance, set())

    def loaded(self, instance: str, lora_name: str) -> None:
        """A load answered: confirmed."""
        self._confirmed[instance].add(lora_name)
        self._maybe[instance].discard(lora_name)

    def uncertain(self, instance: str, lora_name: str) -> None:
        """A load or unload without an answer: it may be there."""
        self._maybe[instance].add(lora_name)

    def unrouted(self, instance: str, lora_name: str) -> None:
        """No longer confirmed (an unload is about to run): no new request goes there for it."""
        self._confirmed[instance].discard(lora_name)

    def unloaded(self, instance: str, lora_name: str, *, gone: bool) -> None:
        """An unload ran: `gone` when the instance surely no longer holds it, else it may."""
        self._confirmed[instance].discard(lora_name)
        if gone:
            self._maybe[instance].discard(lora_name)
        else:
            self._maybe[instance].add(lora_name)

    def listed(self, instance: str, held: set[str]) -> None:
        """The instance listed what it holds: that is the whole truth."""
        self._confirmed[instance] = held
        self._maybe.pop(instance, None)

    def distrust(self, instance: str) -> None:
        """Its holdings are unknown (a listing failed): confirm nothing, sweep what it may hold."""
        self._maybe[instance] |= self._confirmed.pop(instance, set())

    def forget(self, instance: str) -> None:
        self._confirmed.pop(instance, None)
        self._maybe.pop(instance, None)
