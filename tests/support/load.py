"""A bounded load of agent sessions through the gateway, for the load test and bench/load_bench.py.

    spec = LoadSpec(sessions=8, turns=3, duration_s=15)
    result = await run_load(gw.url, spec, api_key=API_KEY, model_id="tiny", pids=Pids(gw.proc.pid, rl_pid))
    assert result.errors == [], result.errors[:5]

Each of `sessions` agents loops until the deadline: a signed Task start (terminal or delayed feedback), `turns`
chat completions with its session header (JSON or SSE, the conversation growing each turn, one `X-Agent-Turn-Id`
per turn), a signed stop, and for terminal Tasks a signed reward. A loop that has begun when the deadline passes is
finished, so no Task is left mid-way. Any status or body other than the contract's success answer is an error. The
RSS of the gateway and of its RL child (with its worker processes, `workers` > 1) is read after a warm-up phase
(load running) and again at the end.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import RequestSigner

MAX_ERRORS_KEPT = 50


@dataclass(frozen=True)
class LoadSpec:
    sessions: int = 8
    turns: int = 3
    duration_s: float = 15.0
    warmup_s: float = 2.0
    delayed_share: float = 0.25  # share of Tasks in delayed-feedback mode (needs a Judge)
    stream_share: float = 0.5  # share of completions sent as SSE
    max_tokens: int = 16
    seed: int = 7


@dataclass(frozen=True)
class Pids:
    gateway: int
    rl_service: int


@dataclass
class LoadResult:
    spec: LoadSpec
    duration_s: float = 0.0
    requests: Counter[str] = field(default_factory=Counter)  # kind -> count
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    tasks: Counter[str] = field(default_factory=Counter)  # reward mode -> finished Tasks
    completions: int = 0  # captured completions of finished Tasks
    acknowledged_samples: int = 0  # sum of reward `sample_count`s
    latencies_ms: dict[str, list[float]] = field(default_factory=dict)
    rss_kib: dict[str, tuple[int, int]] = field(default_factory=dict)  # process -> (after warm-up, at the end)

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    def error(self, text: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(text)

    def rss_growth_mib(self, process: str) -> float:
        before, after = self.rss_kib[process]
        return (after - before) / 1024

    def summary(self) -> dict[str, Any]:
        def pct(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

        return {
            "sessions": self.spec.sessions, "turns": self.spec.turns, "duration_s": round(self.duration_s, 2),
            "requests": self.total_requests, "requests_by_kind": dict(self.requests),
            "requests_per_s": round(self.total_requests / self.duration_s, 1) if self.duration_s else 0.0,
            "errors": self.error_count, "tasks": dict(self.tasks), "completions": self.completions,
            "acknowledged_samples": self.acknowledged_samples,
            "latency_ms": {kind: {"p50": round(pct(v, 0.5), 1), "p99": round(pct(v, 0.99), 1)}
                           for kind, v in sorted(self.latencies_ms.items())},
            "rss_mib": {name: {"before": round(b / 1024, 1), "after": round(a / 1024, 1),
                               "growth": round((a - b) / 1024, 1)} for name, (b, a) in self.rss_kib.items()},
        }


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (an RL Service worker group: the group and its workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def tree_rss_kib(pid: int) -> int:
    total = 0
    for p in descendants(pid):
        try:
            total += rss_kib(p)
        except (OSError, RuntimeError):
            continue  # exited between the listing and the read
    return total


def child_pid(parent: int, needle: str) -> int:
    """The pid of `parent`'s child whose command line contains `needle` (the gateway's RL Service)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and needle in cmdline:
            return int(entry.name)
    raise LookupError(f"no child of {parent} running {needle!r}")


class _Agent:
    def __init__(self, index: int, client: httpx.AsyncClient, signer: RequestSigner, result: LoadResult, *,
                 model_id: str, rng: random.Random) -> None:
        self.index, self.client, self.signer, self.result = index, client, signer, result
        self.model_id, self.rng = model_id, rng
        self.loops = 0

    async def _call(self, kind: str, method: str, path: str, *, json: Any = None, signed: bool = False,
                    headers: dict[str, str] | None = None, expect: int = 200) -> httpx.Response | None:
        body = b"" if json is None else orjson.dumps(json)
        h = dict(headers or {})
        if json is not None:
            h["content-type"] = "application/json"
        request = self.client.build_request(method, path, content=body, headers=h)
        if signed:
            self.signer.sign_httpx(request)
        self.result.requests[kind] += 1
        t0 = time.perf_counter()
        try:
            r = await self.client.send(request)
        except httpx.HTTPError as exc:
            self.result.error(f"{kind}: {type(exc).__name__}: {exc}")
            return None
        self.result.latencies_ms.setdefault(kind, []).append((time.perf_counter() - t0) * 1000)
        if r.status_code != expect:
            self.result.error(f"{kind}: {r.status_code} {r.text[:300]}")
            return None
        return r

    async def _completion(self, session: str, turn: str, messages: list[dict[str, Any]]) -> str | None:
        stream = self.rng.random() < self.result.spec.stream_share
        body = {"model": self.model_id, "messages": messages, "max_tokens": self.result.spec.max_tokens,
                "stream": stream}
        headers = {"X-Agent-Session-Id": session, "X-Agent-Turn-Id": turn}
        kind = "chat_sse" if stream else "chat_json"
        if not stream:
            r = await self._call(kind, "POST", "/v1/chat/completions", json=body, headers=headers)
            if r is None:
                return None
            return r.json()["choices"][0]["message"]["content"] or ""
        self.result.requests[kind] += 1
        t0 = time.perf_counter()
        text, done = [], False
        try:
            async with self.client.stream("POST", "/v1/chat/completions", content=orjson.dumps(body),
                                          headers={**headers, "content-type": "application/json"}) as r:
                if r.status_code != 200:
                    self.result.error(f"{kind}: {r.status_code} {(await r.aread())[:300]!r}")
                    return None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    for choice in orjson.loads(line[6:]).get("choices") or []:
                        text.append((choice.get("delta") or {}).get("content") or "")
        except httpx.HTTPError as exc:
            self.result.error(f"{kind}: {type(exc).__name__}: {exc}")
            return None
        self.result.latencies_ms.setdefault(kind, []).append((time.perf_counter() - t0) * 1000)
        if not done:
            self.result.error(f"{kind}: stream ended without [DONE]")
            return None
        return "".join(text)

    async def one_task(self) -> None:
        spec = self.result.spec
        self.loops += 1
        session = f"load-{self.index}-{self.loops}"
        mode = "delayed_feedback" if self.rng.random() < spec.delayed_share else "terminal"
        r = await self._call("task_start", "POST", "/v1/rl/tasks/start", json={"reward_mode": mode}, signed=True,
                             headers={"X-Agent-Session-Id": session}, expect=201)
        if r is None:
            return
        t = r.json()["rl_task_id"]
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a terse assistant."}]
        for turn in range(spec.turns):
            messages.append({"role": "user", "content": f"agent {self.index} task {self.loops} question {turn}"})
            reply = await self._completion(session, f"u{turn}", messages)
            if reply is None:
                return
            messages.append({"role": "assistant", "content": reply})
        r = await self._call("task_stop", "POST", f"/v1/rl/tasks/{t}/stop", signed=True)
        if r is None:
            return
        if r.json().get("status") != "finalized":
            self.result.error(f"task_stop: task {t} is {r.json().get('status')}, not finalized")
            return
        if mode == "terminal":
            reward = round(self.rng.random(), 3)
            r = await self._call("task_reward", "POST", f"/v1/rl/tasks/{t}/reward", json={"reward": reward},
                                 signed=True)
            if r is None:
                return
            count = r.json()["sample_count"]
            if count != spec.turns:
                self.result.error(f"task_reward: {t} acknowledged {count} samples, expected {spec.turns}")
            self.result.acknowledged_samples += count
        self.result.tasks[mode] += 1
        self.result.completions += spec.turns

    async def run_until(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            await self.one_task()


async def run_load(url: str, spec: LoadSpec, *, api_key: bytes, model_id: str, pids: Pids) -> LoadResult:
    """Run `spec` against the gateway at `url`; RSS of both processes after the warm-up and at the end."""
    result = LoadResult(spec)
    signer = RequestSigner(api_key)
    rng = random.Random(spec.seed)
    # Idle connections are dropped well before the gateway's keep-alive timeout (5 s): a request sent on a connection
    # the server is closing at that moment is lost (httpx's default expiry is the same 5 s, a race under load).
    limits = httpx.Limits(max_connections=spec.sessions * 2, max_keepalive_connections=spec.sessions * 2,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits, trust_env=False) as client:
        agents = [_Agent(i, client, signer, result, model_id=model_id, rng=random.Random(rng.random()))
                  for i in range(spec.sessions)]
        started = time.monotonic()
        deadline = started + spec.warmup_s + spec.duration_s
        runs = [asyncio.create_task(a.run_until(deadline), name=f"agent-{a.index}") for a in agents]
        await asyncio.sleep(spec.warmup_s)
        before = {"gateway": rss_kib(pids.gateway), "rl_service": tree_rss_kib(pids.rl_service)}
        try:
            await asyncio.gather(*runs)
        finally:
            for run in runs:
                run.cancel()
        result.duration_s = time.monotonic() - started
        result.rss_kib = {"gateway": (before["gateway"], rss_kib(pids.gateway)),
                          "rl_service": (before["rl_service"], tree_rss_kib(pids.rl_service))}
    return result
