"""The gateway's domain errors answered over HTTP, in one place: each contract code with its status (CONTRACT §3,
§3.8). Domain code raises `LoraError` / `CaptureFailed` with a code and never knows a status."""

from __future__ import annotations

from starlette.responses import Response

from .lora.lora_types import LoraError
from .responses import envelope, passthrough
from .rl.rl_client import CaptureFailed

STATUS_OF_CODE = {
    "invalid_lora_request": 400,
    "invalid_lora_name": 400,
    "invalid_request": 400,
    "instance_address_refused": 400,
    "instance_not_found": 404,
    "canary_conflict": 409,
    "completion_conflict": 409,
    "instance_conflict": 409,
    "instance_limit_reached": 409,
    "instance_static": 409,
    "lora_cas_conflict": 409,
    "no_canary": 409,
    "internal_error": 500,
    "invalid_lora_state": 500,
    "lora_activation_failed": 502,
    "lora_load_failed": 502,
    "rl_hook_failed": 502,
    "gateway_closing": 503,
    "lora_capacity_exhausted": 503,
    "lora_unavailable": 503,
    "no_capture_instances": 503,
    "no_healthy_instances": 503,
    "no_instances": 503,
    "rl_hook_timeout": 504,
}


def error_answer(exc: LoraError | CaptureFailed) -> Response:
    """The envelope of a domain error (a code missing from the table is a bug: 500), or a relayed RL answer."""
    if isinstance(exc, CaptureFailed) and exc.relayed is not None:
        return passthrough(exc.relayed)
    return envelope(STATUS_OF_CODE.get(exc.code, 500), exc.code, exc.message)

