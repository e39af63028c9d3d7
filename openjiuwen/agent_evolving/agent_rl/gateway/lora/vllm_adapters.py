"""vLLM's dynamic LoRA endpoints, one call each, every call bounded by the caller's deadline (CONTRACT §3.8):
load, unload, and the listing of what an instance holds. Outcomes only; what they mean for routing is the LoRA
manager's business."""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Any

import httpx

from ...common.lineage import InvalidLineage, parse_version_name, split_line
from ..instances.instances import Instance
from .lora_types import ActiveLora

log = logging.getLogger("openjiuwen.agent_rl.gateway.lora")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
MODELS_PATH = "/v1/models"
_ALREADY_LOADED = "already been loaded"  # vLLM's 400 text for a repeated load (load_lora_again.txt)


class Load(enum.Enum):
    NEW = "new"  # 2xx: this call loaded it
    ALREADY = "already"  # 400 "already been loaded": it was there
    FAILED = "failed"  # any other answer: not loaded
    UNKNOWN = "unknown"  # timeout or transport error: it may land later
    UNREACHABLE = "unreachable"  # the connection was refused: nothing was sent, the instance is down
    NO_ROOM = "no_room"  # adapter paging: the instance is full of adapters in use; nothing was sent

    @property
    def held(self) -> bool:
        return self in (Load.NEW, Load.ALREADY)


class AdapterClient:
    def __init__(self, client: httpx.AsyncClient | None = None) -> None:
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(trust_env=False)

    async def load(self, instance: Instance, lora: ActiveLora, deadline: float) -> tuple[Load, str]:
        """The outcome and, when not loaded, why."""
        body = {"lora_name": lora.lora_name, "lora_path": lora.lora_path}
        try:
            resp = await self._call("POST", instance, LOAD_PATH, body, deadline)
        except httpx.ConnectError as exc:
            return Load.UNREACHABLE, f"{instance.name}: connection failed ({type(exc).__name__})"
        except (httpx.HTTPError, TimeoutError) as exc:
            return Load.UNKNOWN, f"{instance.name}: no answer ({type(exc).__name__})"
        if resp.is_success:
            return Load.NEW, ""
        if resp.status_code == 400 and _ALREADY_LOADED in resp.text:
            return Load.ALREADY, ""
        return Load.FAILED, f"{instance.name}: status {resp.status_code}: {resp.text[:200]}"

    async def unload(self, instance: Instance, name: str, deadline: float) -> bool:
        """True when the instance no longer holds the adapter (200, or 404 = already gone)."""
        try:
            resp = await self._call("POST", instance, UNLOAD_PATH, {"lora_name": name}, deadline)
        except (httpx.HTTPError, TimeoutError) as exc:
            log.warning("unload of %s on %s got no answer (%s)", name, instance.name, type(exc).__name__)
            return False
        if resp.is_success or resp.status_code == 404:
            return True
        log.warning("unload of %s on %s: status %d: %s", name, instance.name, resp.status_code, resp.text[:200])
        return False

    async def held(self, instance: Instance, deadline: float) -> set[str] | None:
        """The versions of the instance's model it holds (`GET /v1/models`); None when it cannot tell."""
        try:
            resp = await self._call("GET", instance, MODELS_PATH, None, deadline)
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:
            log.warning("could not list the adapters of %s (%s)", instance.name, type(exc).__name__)
            return None
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            log.warning("could not list the adapters of %s (status %d)", instance.name, resp.status_code)
            return None
        held = set()
        for entry in entries:
            model_id = entry.get("id") if isinstance(entry, dict) else None
            if _model_of_version(model_id) == instance.model:  # a version of any line of the model
                held.add(model_id)
        return held

    async def aclose(self) -> None:
        """Close the HTTP client when it is ours."""
        if self._owns_client:
            await self._client.aclose()

    async def _call(
        self, method: str, instance: Instance, path: str, body: dict[str, Any] | None, deadline: float
    ) -> httpx.Response:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise TimeoutError("operation deadline passed")
        async with asyncio.timeout_at(deadline):  # httpx's timeout is per phase; this bounds the whole call
            return await self._client.request(method, instance.base_url + path, json=body, timeout=remaining)


def _model_of_version(name: object) -> str | None:
    parsed = parse_version_name(name)
    if parsed is None:
        return None
    try:
        return split_line(parsed[0])[0]
    except InvalidLineage:
        return None
