"""The console's lineage list (gateway/console/console.py `Console.lineages`) against a scripted RL answer, and the page
script's rule that no text ever becomes markup. The real RL Service's answer is covered by tests/system/test_console.py."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from openjiuwen.agent_evolving.agent_rl.gateway.console.console import Console
from openjiuwen.agent_evolving.agent_rl.gateway.console.console_auth import COOKIE_NAME, ConsoleAuth
from openjiuwen.agent_evolving.agent_rl.gateway.responses import envelope

KEY = b"k" * 32
ASSETS = Path(__file__).resolve().parents[2] / "openjiuwen/agent_evolving/agent_rl/gateway/console/console_assets"
SUPPORT = {"lineage": "support", "line": "tiny:support", "first_used_at": "2026-12-01T00:00:00+00:00",
           "pending_samples": 3, "active_run": None}


class ScriptedControl:
    """The RL Service's answer to `GET /v1/rl/lineages`, and what the console asked for."""

    def __init__(self, answer: Response) -> None:
        self.answer = answer
        self.calls: list[tuple[str, str, str]] = []

    async def forward(self, method: str, path: str, *, query: str = "", **_: Any) -> Response:
        self.calls.append((method, path, query))
        return self.answer


def console(answer: Response) -> tuple[Console, ScriptedControl]:
    control = ScriptedControl(answer)
    return Console(auth=ConsoleAuth(KEY), control=control, loras=None, supervisor=None,  # type: ignore[arg-type]
                   model_id="tiny", assets={}), control


def request(query: str = "", *, session: bool = True) -> Request:
    headers = []
    if session:
        cookie, _ = ConsoleAuth(KEY).issue(now_ms=int(time.time() * 1000))
        headers.append((b"cookie", f"{COOKIE_NAME}={cookie}".encode()))
    return Request({"type": "http", "method": "GET", "path": "/console/api/lineages", "query_string": query.encode(),
                    "headers": headers})


def listing(items: list[dict[str, Any]], next_cursor: str | None = None) -> Response:
    return Response(orjson.dumps({"items": items, "next_cursor": next_cursor}), media_type="application/json")


async def test_the_first_page_starts_with_default_and_passes_only_limit_and_cursor() -> None:
    c, control = console(listing([SUPPORT], next_cursor="c1"))
    answer = await c.lineages(request("limit=1&status=x&lineage=y"))
    assert answer.status_code == 200 and answer.headers["cache-control"] == "no-store"
    assert orjson.loads(answer.body) == {"items": [{"lineage": "default", "line": "tiny"}, SUPPORT],
                                         "next_cursor": "c1", "lineages_supported": True}
    assert control.calls == [("GET", "/v1/rl/lineages", "limit=1")]


async def test_a_later_page_has_no_second_default() -> None:
    c, control = console(listing([SUPPORT]))
    body = orjson.loads((await c.lineages(request("cursor=c1"))).body)
    assert body["items"] == [SUPPORT] and body["lineages_supported"] is True
    assert control.calls == [("GET", "/v1/rl/lineages", "cursor=c1")]


async def test_an_rl_service_without_lineages_gives_default_alone() -> None:
    c, _ = console(envelope(404, "not_found", "no such route"))
    body = orjson.loads((await c.lineages(request())).body)
    assert body == {"items": [{"lineage": "default", "line": "tiny"}], "next_cursor": None,
                    "lineages_supported": False}


async def test_errors_pass_through_and_a_malformed_list_is_a_502_never_a_500() -> None:
    c, _ = console(envelope(503, "rl_service_unavailable", "the RL Service is not running"))
    answer = await c.lineages(request())
    assert (answer.status_code, orjson.loads(answer.body)["error"]["code"]) == (503, "rl_service_unavailable")
    for bad in (b"not json", b"[]", b'{"items": 3}', b'{"next_cursor": null}'):
        c, _ = console(Response(bad, media_type="application/json"))
        answer = await c.lineages(request())
        assert (answer.status_code, orjson.loads(answer.body)["error"]["code"]) == (502, "upstream_invalid"), bad


async def test_without_a_session_nothing_is_asked() -> None:
    c, control = console(listing([SUPPORT]))
    answer = await c.lineages(request(session=False))
    assert answer.status_code == 401 and control.calls == []


def test_the_console_scripts_never_turn_text_into_markup() -> None:
    # Record fields (lineage names, Task ids, failure reasons) reach the page only as text nodes and attributes.
    sinks = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|DOMParser|createContextualFragment")
    for script in sorted(ASSETS.glob("*.js")):
        code = re.sub(r"^\s*//.*$", "", script.read_text(), flags=re.MULTILINE)  # the header says "never innerHTML"
        assert not sinks.search(code), script.name
