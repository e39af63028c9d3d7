"""Internal routes for the RL Service child (CONTRACT §3.8): LoRA status and CAS activation, and the canary slot
(docs/rollout.md). Loopback only, with the child's bearer token: a router dependency, closed while no child lives."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from ...common import json_nesting
from ...common.errors import ApiError
from ..assembly import Gateway
from ..lora.policy_lines import model_of_version
from ..responses import json_response
from .deps import GatewayDep, checked_line, internal_caller

router = APIRouter(prefix="/internal/v1/rl", dependencies=[Depends(internal_caller)])


async def _string_fields(request: Request, names: tuple[str, ...], what: str) -> dict[str, Any]:
    """The named fields of the JSON body, strings all (`share` excepted), else 400 `invalid_lora_request`."""
    try:
        data = json_nesting.loads(await request.body())
        fields = {name: data[name] for name in names}
        if not all(isinstance(v, str) for k, v in fields.items() if k != "share"):
            raise TypeError("fields must be strings")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ApiError(400, "invalid_lora_request", f"invalid {what} request: {exc}") from None
    return fields


def _of_served_model(fields: dict[str, Any], gw: Gateway) -> dict[str, Any]:
    """The fields, when `lora_name` is a version of a line of the gateway's model: 400 `invalid_lora_name` when it is
    a version of another model's line (a malformed name is the manager's 400 `invalid_lora_request`)."""
    model = model_of_version(fields["lora_name"])
    if model is not None and model != gw.model_id:
        raise ApiError(400, "invalid_lora_name", f"{fields['lora_name']} is not a version of {gw.model_id}")
    return fields


@router.get("/loras/{model}")
async def lora_status(model: str, gw: GatewayDep) -> Response:
    """`{model}` is a line: the model id (the default lineage) or `<model>:<lineage>`."""
    return json_response(await gw.loras.refresh_status(checked_line(model, gw)))


@router.post("/loras/activate")
async def activate(request: Request, gw: GatewayDep) -> Response:
    args = await _string_fields(request, ("base_model", "lora_name", "lora_path", "expected_lora_name"), "activation")
    return json_response(await gw.loras.activate(**_of_served_model(args, gw)))


@router.post("/loras/retire")
async def retire(request: Request, gw: GatewayDep) -> Response:
    """A lineage archived or deleted at the RL Service (docs/lineages.md "Lifecycle"): `{"line"}` serves nothing
    more. The default line (the model id) is never retired: 400 `invalid_lineage`."""
    line = checked_line((await _string_fields(request, ("line",), "retire"))["line"], gw)
    if line == gw.model_id:
        raise ApiError(400, "invalid_lineage", "the default lineage's line is never retired")
    return json_response(await gw.loras.retire(line))


# Canary: a candidate beside the active version, switched with CAS like activation.

@router.get("/canary/{model}")
async def canary_status(model: str, gw: GatewayDep) -> Response:
    return json_response(gw.loras.canary_status(checked_line(model, gw)))


@router.post("/canary/start")
async def canary_start(request: Request, gw: GatewayDep) -> Response:
    args = await _string_fields(
        request, ("base_model", "lora_name", "lora_path", "expected_lora_name", "share"), "canary")
    return json_response(await gw.loras.start_canary(**_of_served_model(args, gw)))


@router.post("/canary/promote")
async def canary_promote(request: Request, gw: GatewayDep) -> Response:
    args = await _string_fields(request, ("base_model", "lora_name", "expected_lora_name"), "canary")
    return json_response(await gw.loras.promote_canary(**_of_served_model(args, gw)))


@router.post("/canary/abort")
async def canary_abort(request: Request, gw: GatewayDep) -> Response:
    args = await _string_fields(request, ("base_model", "lora_name"), "canary")
    return json_response(await gw.loras.abort_canary(**_of_served_model(args, gw)))
