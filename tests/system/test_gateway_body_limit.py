"""The gateway bounds every request body (`global.maxBodyBytes`): larger bodies get 413 `payload_too_large`, from
`Content-Length` before anything is read, or while reading a chunked body — on the unsigned inference routes too,
where anyone who reaches the port could otherwise make the gateway buffer without limit. Real process, real socket.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import sign_request
from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import API_KEY, GatewayProcess

pytestmark = pytest.mark.system

LIMIT = 4096
ROUTES = ["/v1/chat/completions", "/v1/messages", "/v1/rl/tasks/start", "/v1/rl/tasks/t1/reward",
          "/v1/rl/training/runs", "/v1/gateway/upload/batch", "/aigw/v1/register-instance", "/v1/rl/service/start"]


@pytest.fixture(scope="module")
def gw(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with FakeVLLM(served_model="tiny") as vllm, GatewayProcess(
        tmp_path_factory.mktemp("body-limit"), redis_url, instances=[vllm],
        global_overrides={"maxBodyBytes": LIMIT},
    ) as gw:
        gw.start_service()
        yield gw


def signed_headers(route: str, body: bytes, session: str | None = None) -> dict[str, str]:
    time.sleep(0.002)  # distinct timestamps: the same body twice in one millisecond would be a replay
    signed = sign_request(API_KEY, "POST", route, body, now_ms=int(time.time() * 1000), session_id=session)
    return {**signed, "content-type": "application/json", **({"X-Agent-Session-Id": session} if session else {})}


def error_code(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


@pytest.mark.parametrize("route", ROUTES)
def test_content_length_over_the_limit_is_413(gw: GatewayProcess, route: str) -> None:
    big = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * LIMIT}]})
    r = gw.http.post(route, content=big, headers=signed_headers(route, big))
    assert error_code(r) == (413, "payload_too_large")


def raw_exchange(gw: GatewayProcess, head: bytes, chunks: list[bytes] = []) -> tuple[int, dict]:  # noqa: B006
    """Send a request head and some body bytes, never finishing the body; read the answer."""
    url = urlsplit(gw.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(head)
        for chunk in chunks:
            s.sendall(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            data = s.recv(65536)
            if not data:
                break
            answer += data
    head_part, _, body = answer.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), orjson.loads(body)


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/rl/tasks/start"])
def test_chunked_body_over_the_limit_is_413_while_reading(gw: GatewayProcess, route: str) -> None:
    head = (f"POST {route} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"400\r\n" + b"x" * 0x400 + b"\r\n"
    status, body = raw_exchange(gw, head, [chunk] * 5)  # 5 KiB sent, the body never ends: decided while reading
    assert (status, body["error"]["code"]) == (413, "payload_too_large")


def test_a_huge_content_length_is_answered_from_the_header_alone(gw: GatewayProcess) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n")
    status, body = raw_exchange(gw, head)
    assert (status, body["error"]["code"]) == (413, "payload_too_large")
    assert gw.http.get("/aigw/v1/health").status_code == 200  # and it keeps serving


def test_bodies_within_the_limit_are_served(gw: GatewayProcess) -> None:
    chat = orjson.dumps({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    chat = chat[:-1] + b" " * (LIMIT - len(chat)) + b"}"  # exactly at the limit
    assert len(chat) == LIMIT
    assert gw.http.post("/v1/chat/completions", content=chat, headers={"content-type": "application/json"}
                        ).status_code == 200
    start = b'{"reward_mode": "terminal"}'
    headers = signed_headers("/v1/rl/tasks/start", start, session="s")
    r = gw.http.post("/v1/rl/tasks/start", content=start, headers=headers)
    assert r.status_code == 201, r.text
