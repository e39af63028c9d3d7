"""Shared fixtures: one private redis-server per test session, a clean `rl:v1:` key space per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest
from redis.asyncio import Redis

from tests.support.redis_server import RedisServer

# Recorded vLLM 0.32 answers, kept in the repository (tests/fixtures/vllm-0.32-cpu/README.md says how).
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm-0.32-cpu"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


async def _delete_owned_keys(redis: Redis) -> None:
    # Only keys under the service prefix, which is all the service may write.
    async for key in redis.scan_iter(match="rl:v1:*", count=1000):
        await redis.delete(key)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    await _delete_owned_keys(client)
    try:
        yield client
    finally:
        await _delete_owned_keys(client)
        await client.aclose()


def load_fixture(name: str) -> dict:
    return orjson.loads((FIXTURES / name).read_bytes())


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


# `make test` hands modules to its workers in collection order, so the folders whose modules run longest (a model
# learning, servers started) go first and the short ones (unit) fill the end of the run instead of a long module
# starting last. Stable: each folder keeps its own order, a module's tests stay together.
_FOLDERS_LONGEST_FIRST = ("learning", "system", "compat", "integration", "unit")


def _folder_rank(item: pytest.Item) -> int:
    parts = item.nodeid.split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    return _FOLDERS_LONGEST_FIRST.index(folder) if folder in _FOLDERS_LONGEST_FIRST else len(_FOLDERS_LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_folder_rank)
