"""Run the RL Service app in-process (lifespan included) behind an httpx client, and build hook bodies."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from redis.asyncio import Redis

from openjiuwen.agent_evolving.agent_rl.online.config import RLServiceConfig, config_from_mapping
from openjiuwen.agent_evolving.agent_rl.online.service import create_app

MODEL_ID = "tiny"  # the model name the recorded vLLM fixtures carry


def make_config(redis_url: str, tmp: Path, **overrides: Any) -> RLServiceConfig:
    data: dict[str, Any] = {
        "redis_url": redis_url,
        "model_id": MODEL_ID,
        "base_model_path": "/models/tiny",
        "lora_repository_path": str(tmp / "loras"),
        "log_path": str(tmp / "rl-service.log"),
        "record_dir": str(tmp / "records"),
        "turn_publish_timeout_seconds": 5.0,
    }
    data.update(overrides)
    return config_from_mapping(data)


@asynccontextmanager
async def running_app(config: RLServiceConfig, **kwargs: Any) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app with its lifespan (owner claim, recovery, sweeper) and a client speaking to it over ASGI."""
    redis = Redis.from_url(config.redis_url.get_secret_value())
    app = create_app(config, redis=redis, **kwargs)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        # As the gateway's RL client does, every request says its body is JSON (the service refuses other bodies).
        async with httpx.AsyncClient(transport=transport, base_url="http://rl.test", timeout=30,
                                     headers={"content-type": "application/json"}) as client:
            yield app, client


def start_headers(session: str, task_id: str, policy: str = "base", model: str = MODEL_ID) -> dict[str, str]:
    return {
        "X-Agent-Session-Id": session,
        "X-AIGW-RL-Task-Id": task_id,
        "X-AIGW-RL-Policy-Name": policy,
        "X-AIGW-RL-Policy-Model": model,
    }


async def start_task(
    client: httpx.AsyncClient, session: str, task_id: str, mode: str = "terminal", **kw: str
) -> httpx.Response:
    return await client.post(
        "/v1/rl/tasks/start", json={"reward_mode": mode}, headers=start_headers(session, task_id, **kw)
    )


def with_user(request: dict[str, Any], text: str) -> dict[str, Any]:
    out = copy.deepcopy(request)
    out["messages"] = list(out["messages"]) + [{"role": "user", "content": text}]
    return out


async def capture(
    client: httpx.AsyncClient,
    task_id: str,
    capture_id: str,
    request: dict[str, Any],
    response: dict[str, Any],
    turn: str | None = None,
) -> tuple[httpx.Response, httpx.Response | None]:
    """`:before` then, if it succeeded, `:after` with the injected request."""
    before = await client.post(
        "/internal/v1/completions:before",
        json={"rl_task_id": task_id, "capture_id": capture_id, "agent_turn_id": turn, "request": request},
    )
    if before.status_code != 200:
        return before, None
    after = await client.post(
        "/internal/v1/completions:after",
        json={
            "rl_task_id": task_id, "capture_id": capture_id, "agent_turn_id": turn,
            "request": before.json()["request"], "response": response,
        },
    )
    return before, after
