"""The RL Service app and the gateway app built in-process as the service and `openjiuwen-rl gateway` build them, for
tests that read their route tables: nothing is served, nothing connects."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI


def service_app(tmp: Path) -> FastAPI:
    from redis.asyncio import Redis

    from openjiuwen.agent_evolving.agent_rl.online.config import config_from_mapping
    from openjiuwen.agent_evolving.agent_rl.online.service import create_app

    url = "redis://127.0.0.1:1/0"  # never connected: building the app does no I/O
    config = config_from_mapping({
        "redis_url": url, "model_id": "tiny", "base_model_path": "/models/tiny",
        "lora_repository_path": str(tmp / "loras"), "log_path": str(tmp / "rl.log"), "trainer_backend": "scripted",
        "judge_endpoint": "http://127.0.0.1:1", "judge_model": "judge",
        "reward_policy": {"sources": {"human": {"deadline_seconds": 60, "fallback": "skip"}}},
    })
    return create_app(config, redis=Redis.from_url(url), token="t" * 16)


def gateway_app(tmp: Path) -> FastAPI:
    from openjiuwen.agent_evolving.agent_rl.gateway.app import build_gateway, create_gateway_app
    from openjiuwen.agent_evolving.agent_rl.gateway.config import gateway_config_from_mapping
    from openjiuwen.agent_evolving.agent_rl.gateway.auth.hmac_auth import HmacVerifier
    from openjiuwen.agent_evolving.agent_rl.gateway.console.console_auth import ConsoleAuth

    config = gateway_config_from_mapping({
        "global": {"hmacKeyFile": str(tmp / "keys.json")},
        "instances": [{"name": "vllm-0", "model": "tiny", "instanceIp": "127.0.0.1", "port": 1}],
        "lora": {"root": str(tmp / "loras"), "statePath": str(tmp / "lora-state.json")},
        "onlineRL": {"command": ["python"], "configPath": str(tmp / "rl.yaml"), "modelId": "tiny"},
    })
    key = b"k" * 32
    gateway = build_gateway(config, verifier=HmacVerifier(key), console_auth=ConsoleAuth(key), env={})
    return create_gateway_app(gateway)


def endpoints(routes: Iterable[Any], prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """(method, path, route) of every endpoint, through included routers and mounts; `{name:converter}` written as
    `{name}`, HEAD left out (implied by GET)."""
    for route in routes:
        inner = getattr(route, "original_router", None)  # an included APIRouter (FastAPI ≥ 0.16x)
        if inner is not None:
            sub = getattr(getattr(route, "include_context", None), "prefix", "") or ""
            yield from endpoints(inner.routes, prefix + sub)
            continue
        if hasattr(route, "routes") and not hasattr(route, "methods"):  # a Mount
            yield from endpoints(route.routes, prefix + getattr(route, "path", ""))
            continue
        path = prefix + re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                yield method, path, route
