"""The status a gateway client gets for a domain error, for tests that raise one directly."""

from __future__ import annotations

from openjiuwen.agent_evolving.agent_rl.gateway.domain_errors import error_answer
from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_types import LoraError
from openjiuwen.agent_evolving.agent_rl.gateway.rl.rl_client import CaptureFailed


def http_status(exc: LoraError | CaptureFailed) -> int:
    return error_answer(exc).status_code
