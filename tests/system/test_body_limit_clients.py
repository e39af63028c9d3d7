"""An ordinary HTTP client that sends a body over the limit reads the 413 `payload_too_large` envelope, from the RL
Service and from the gateway (both bound bodies with common/request_guards.py), instead of a broken pipe or a reset.

Python's `urllib.request` writes the whole body before it reads the answer. A server that answers 413 and closes
at once leaves the rest of the body unread in its socket, and the kernel answers the client's next segments with a
reset: the client dies in `sendall` (BrokenPipeError / ConnectionResetError) and never sees the 413. The servers
answer with `Connection: close` and read (and discard) the rest of the body, within a bound, before closing.

Real processes, real sockets, the default limit (32 MiB) and a 33 MiB body; with Content-Length, and chunked
(no Content-Length: the limit is hit while a route reads the body).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import RequestSigner
from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import API_KEY, GatewayProcess
from tests.support.service_app import start_headers
from tests.support.service_process import ServiceProcess

pytestmark = pytest.mark.system

DEFAULT_LIMIT = 33_554_432


@pytest.fixture(scope="module")
def big() -> bytes:
    """33 MiB of JSON: over the default limit (built once per module, not at collection)."""
    body = b'{"reward_mode": "terminal", "pad": "' + b"x" * (33 * 1024 * 1024) + b'"}'
    assert len(body) > DEFAULT_LIMIT
    return body


def chunks(body: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i:i + size]


def post(url: str, body: bytes | Iterator[bytes], headers: dict[str, str]) -> tuple[int, dict, dict]:
    """(status, envelope, response headers) as urllib sees them; an iterable body goes chunked."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, orjson.loads(answer.read()), dict(answer.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read()), dict(exc.headers)


def assert_413(status: int, envelope: dict, headers: dict) -> None:
    assert status == 413
    assert envelope["error"]["code"] == "payload_too_large"
    assert headers.get("connection", headers.get("Connection", "")).lower() == "close"


@pytest.fixture(scope="module")
def service(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("body-413"), redis_url) as svc:
        yield svc


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_service_answers_413_to_a_33_mib_upload(service: ServiceProcess, big: bytes, framing: str) -> None:
    headers = {"content-type": "application/json", **start_headers(f"s-413-{framing}", f"t-413-{framing}")}
    body = big if framing == "content-length" else chunks(big)
    assert_413(*post(f"{service.url}/v1/rl/tasks/start", body, headers))
    # The service is unharmed: the same route with a small body.
    status, task, _ = post(f"{service.url}/v1/rl/tasks/start", b'{"reward_mode": "terminal"}', headers)
    assert status == 201, task


def test_service_answers_413_to_a_33_mib_hook_body(service: ServiceProcess, big: bytes) -> None:
    """The hook routes are where large bodies arrive: `:after` carries the whole completion."""
    assert_413(*post(f"{service.url}/internal/v1/completions:after", big, {"content-type": "application/json"}))


@pytest.fixture(scope="module")
def gateway(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with FakeVLLM(served_model="tiny") as vllm, GatewayProcess(
        tmp_path_factory.mktemp("gw-413"), redis_url, instances=[vllm],
    ) as gw:
        gw.start_service()
        yield gw


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/rl/tasks/start"])
def test_gateway_answers_413_to_a_33_mib_upload(
    gateway: GatewayProcess, big: bytes, route: str, framing: str
) -> None:
    headers = {"content-type": "application/json"}
    if route.startswith("/v1/rl/"):
        headers.update(RequestSigner(API_KEY).headers("POST", route, big))
    body = big if framing == "content-length" else chunks(big)
    assert_413(*post(f"{gateway.url}{route}", body, headers))
    assert gateway.http.get("/aigw/v1/health").status_code == 200


def test_drain_is_bounded_and_the_answer_comes_first(service: ServiceProcess) -> None:
    """A client that declares a huge body and trickles it is not read forever: it has the whole 413 at once, and
    the server closes after its idle bound (common/request_guards.py: DRAIN_IDLE_SECONDS), well before DRAIN_SECONDS."""
    import socket
    from urllib.parse import urlsplit

    from openjiuwen.agent_evolving.agent_rl.common import request_guards

    url = urlsplit(service.url)
    with socket.create_connection((url.hostname, url.port), timeout=request_guards.DRAIN_SECONDS + 30) as s:
        s.sendall(b"POST /v1/rl/tasks/start HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000000\r\n\r\n" + b"x" * 1024)
        started = time.monotonic()
        answer, first_at = b"", None
        while True:
            data = s.recv(65536)
            if not data:
                break
            first_at = first_at or time.monotonic() - started
            answer += data
        closed_at = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 413 ") and b"payload_too_large" in answer
    assert b"connection: close" in answer.lower()
    assert first_at is not None and first_at < request_guards.DRAIN_IDLE_SECONDS
    assert request_guards.DRAIN_IDLE_SECONDS - 0.5 <= closed_at < request_guards.DRAIN_SECONDS
