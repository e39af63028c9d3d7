"""HMAC-signed LoRA status and deletion, and the vLLM instance registry (CONTRACT §3.3, issue 19 item 4).

Registration takes the api key or the instance key; removal and listing the api key only. `LoraError`s are answered
by the app's one handler."""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, Depends
from starlette.responses import Response

from ...common import json_nesting
from ...common.errors import ApiError
from ..responses import json_response
from .deps import GatewayDep, SignedBody, any_key_signed_body, checked_line

router = APIRouter()


MAX_LORAS_FIELD = "maxLoras"  # optional: the instance's LoRA capacity (adapter paging; absent: the gateway default)


def _registration(body: bytes) -> tuple[str, str, str, int, int | None]:
    try:
        data = json_nesting.loads(body)
        name, model, host, port = data["name"], data["model"], data["instanceIp"], int(data["port"])
        if not all(isinstance(v, str) and v for v in (name, model, host)):
            raise ValueError("name, model and instanceIp must be non-empty strings")
        max_loras = data.get(MAX_LORAS_FIELD)
        if max_loras is not None and (isinstance(max_loras, bool) or not isinstance(max_loras, int)
                                      or not 0 <= max_loras <= 100_000):
            raise ValueError(f"{MAX_LORAS_FIELD} must be an integer in 0..100000 (0: unlimited)")
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ApiError(400, "invalid_request", f"invalid registration: {exc}") from None
    return name, model, host, port, max_loras


def _removal(body: bytes) -> str:
    try:
        name = json_nesting.loads(body)["name"]
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty string")
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ApiError(400, "invalid_request", f"invalid removal: {exc}") from None
    return name


@router.get("/v1/loras/{model}")
async def lora_status(model: str, _: SignedBody, gw: GatewayDep) -> Response:
    """`{model}` is a line: the model id (the default lineage) or `<model>:<lineage>`."""
    return json_response(await gw.loras.refresh_status(checked_line(model, gw)))


@router.delete("/v1/loras/{model}")
async def lora_delete(model: str, _: SignedBody, gw: GatewayDep) -> Response:
    await gw.loras.deactivate(checked_line(model, gw))
    return Response(status_code=204)


@router.post("/aigw/v1/register-instance")
async def register_instance(body: Annotated[bytes, Depends(any_key_signed_body)], gw: GatewayDep) -> Response:
    if not gw.ready:
        raise ApiError(503, "not_ready", "the gateway is starting; retry")
    name, model, host, port, max_loras = _registration(body)
    # A bad port, a name taken, the cap reached: LoraError with the client's status, never a 500.
    serving = await gw.loras.register_instance(name, model, host, port, max_loras=max_loras)
    return json_response({"status": "registered", "name": name, "serving": serving})


@router.post("/aigw/v1/unregister-instance")
async def unregister_instance(body: SignedBody, gw: GatewayDep) -> Response:
    """Operator only (the api key; the instance key is refused): remove a registered instance. The name travels in
    the signed body, so a captured signature cannot be pointed at another instance."""
    name = _removal(body)
    gw.loras.remove_instance(name)
    return json_response({"status": "removed", "name": name})


@router.get("/aigw/v1/instances")
async def list_instances(_: SignedBody, gw: GatewayDep) -> Response:
    return json_response({"items": gw.loras.instances(), "registered": gw.registry.registered_count(),
                          "max_registered": gw.registry.max_registered})
