"""Several lineages' LoRA adapters on one base model in one process, each forward routed to one adapter.

peft keeps every adapter of a PeftModel in each LoRA layer, keyed by name. Its own switch (`set_adapter`) also flips
`requires_grad` so that only the active adapter is trainable; an autograd graph already recorded for another adapter
then stops accumulating gradients into it (a leaf that no longer requires grad gets none), so a step that runs A's
rows, then B's, then one backward would lose A's gradients. `route` only changes which adapter the layers apply, and
`set_trainable` keeps every adapter of a step trainable. peft's per-row `adapter_names` (mixed batches) is refused in
training mode (peft/tuners/lora/model.py, 0.21: "Cannot pass `adapter_names` when the model is in training mode"), so
rows of different adapters run as per-adapter forwards whose losses are summed into one backward (warm_group.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any


def tuner_layers(model: Any) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def route(layers: Iterable[Any], adapter: str) -> None:
    """The layers apply `adapter` (and no other) from now on; nothing else changes."""
    for layer in layers:
        layer._active_adapter = [adapter]  # what `active_adapters` reads in every LoRA layer's forward


def adapter_parameters(model: Any, adapter: str) -> list[Any]:
    """The parameters of `adapter` alone (peft names them `...lora_A.<adapter>.weight`)."""
    marker = f".{adapter}."
    return [p for name, p in model.named_parameters() if marker in name and "lora_" in name]


def set_trainable(model: Any, adapters: Iterable[str]) -> None:
    """Exactly the parameters of `adapters` require grad (the base model and every other adapter are frozen)."""
    wanted = {f".{a}." for a in adapters}
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name and any(w in name for w in wanted))


class AdapterView:
    """The model as one lineage's PPO update sees it (ppo_update.PPOUpdate): calling it runs the base model with
    that lineage's adapter only, `parameters()` are that adapter's, `disable_adapter()` is the frozen base."""

    def __init__(self, peft_model: Any, adapter: str, layers: list[Any]) -> None:
        self._peft = peft_model
        self._adapter = adapter
        self._layers = layers
        self._params = adapter_parameters(peft_model, adapter)
        if not self._params:
            raise RuntimeError(f"adapter {adapter!r} has no parameters in the model")

    @property
    def adapter(self) -> str:
        return self._adapter

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        route(self._layers, self._adapter)
        return self._peft(*args, **kwargs)

    def parameters(self) -> Iterator[Any]:
        return iter(self._params)

    def disable_adapter(self) -> AbstractContextManager[Any]:
        return self._peft.disable_adapter()

    def train(self, mode: bool = True) -> AdapterView:
        self._peft.train(mode)
        return self

    def eval(self) -> AdapterView:
        self._peft.eval()
        return self
