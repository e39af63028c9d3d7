"""Health of the vLLM instances (issue 19, item 4): periodic `GET /health` probes that take a dead instance out of
routing and the activation quorum, and hand a recovered one to the LoRA manager for readmission.

An instance leaves after `failure_threshold` failed probes in a row (a probe fails on any answer but 200, a transport
error or `timeout_s`). A failed instance is probed on every round; the first 200 readmits it: the LoRA manager loads
the active adapter and the versions still leased, and only then puts it back into routing. One event loop, no locks.

Start-up window (issue 28 item 12): a request that finds no healthy instance asks for a check at once (`recheck`)
instead of waiting for the next round, so a vLLM that came up just after the last probe serves it. Checks are
single-flight (a periodic round and any number of such requests share one), at most one starts per
`RECHECK_MIN_GAP_S` (a burst of requests while every instance is down probes each instance once, not once per
request), and a request waits for it at most `recheck_wait_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from .instances import Instance, InstanceRegistry

log = logging.getLogger("openjiuwen.agent_rl.gateway.health")

HEALTH_PATH = "/health"  # vLLM's liveness route: 200 with an empty body
# A check asked for by a request starts only when the last one ended at least this long ago: while every instance
# stays down, requests are answered 503 from that check's result rather than each probing every instance again.
RECHECK_MIN_GAP_S = 0.5


class InstanceProbe:
    """One `GET /health` of an instance within `timeout_s`: True on 200. Shared by the monitor and the LoRA manager
    (which probes an instance before it registers)."""

    def __init__(self, timeout_s: float, client: httpx.AsyncClient | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        self._timeout_s = timeout_s
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(trust_env=False)

    async def __call__(self, instance: Instance) -> bool:
        try:
            async with asyncio.timeout(self._timeout_s):
                resp = await self._client.get(instance.base_url + HEALTH_PATH, timeout=self._timeout_s)
        except (httpx.HTTPError, TimeoutError):
            return False
        return resp.status_code == 200

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


class HealthMonitor:
    def __init__(
        self,
        registry: InstanceRegistry,
        *,
        readmit: Callable[[Instance], Awaitable[None]],
        interval_s: float,
        timeout_s: float,
        failure_threshold: int,
        client: httpx.AsyncClient | None = None,
        probe: InstanceProbe | None = None,
    ) -> None:
        if not (interval_s > 0 and timeout_s > 0 and failure_threshold >= 1):
            raise ValueError("interval_s and timeout_s must be positive, failure_threshold at least 1")
        self._registry = registry
        self._readmit = readmit
        self._interval_s = interval_s
        self._threshold = failure_threshold
        self.probe = probe if probe is not None else InstanceProbe(timeout_s, client)
        self._failures: dict[str, int] = {}  # consecutive failed probes of a serving instance
        self._current: asyncio.Task[None] | None = None  # the check running now, shared (single-flight)
        self._last_ended = float("-inf")  # monotonic time the last shared check ended
        # A request waits for an urgent check at most one probe timeout: the probe itself is bounded by it, and a
        # readmission that loads adapters may take longer (it goes on; the request gets its 503 meanwhile).
        self.recheck_wait_s = timeout_s

    async def check_once(self, *, at_start: bool = False) -> None:
        """Probe every instance at once; take out those past the threshold (`at_start`: after one failure, since
        nothing is known of them yet), readmit those that answer again."""
        instances = self._registry.all()
        results = await asyncio.gather(*(self.probe(i) for i in instances))
        present = {i.name for i in instances}
        self._failures = {n: c for n, c in self._failures.items() if n in present}  # removed ones are forgotten
        back: list[Instance] = []
        for instance, ok in zip(instances, results):
            if self._registry.get(instance.name) != instance:
                continue  # removed while we probed
            serving = self._registry.is_serving(instance.name)
            if ok:
                self._failures.pop(instance.name, None)
                if not serving:
                    back.append(instance)
                continue
            if not serving:
                continue
            count = self._failures.get(instance.name, 0) + 1
            self._failures[instance.name] = count
            if count >= self._threshold or at_start:
                self._registry.set_serving(instance, False)
                self._failures.pop(instance.name, None)
                log.warning("instance %s at %s failed %d health checks: out of routing until it answers again",
                            instance.name, instance.base_url, count)
        # Readmission loads adapters (bounded by the LoRA operation timeout); one slow instance must not hold back
        # the others, so they run together.
        await asyncio.gather(*(self._readmit_logged(i) for i in back))

    async def run(self) -> None:
        """Check every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(self._interval_s)
            await asyncio.wait({self._shared_check()})

    async def recheck(self) -> None:
        """Check now, for a request that found no healthy instance: join the check already running, or start one
        unless the last ended under `RECHECK_MIN_GAP_S` ago; wait for it at most `recheck_wait_s`. Never raises
        (the request then routes on whatever the registry says)."""
        if self._current is None and time.monotonic() - self._last_ended < RECHECK_MIN_GAP_S:
            return
        # `wait`, not `wait_for`: the request's timeout must not cancel a check other callers share.
        await asyncio.wait({self._shared_check()}, timeout=self.recheck_wait_s)

    def _shared_check(self) -> asyncio.Task[None]:
        if self._current is None:
            self._current = asyncio.create_task(self._check_logged(), name="instance-health-check")
        return self._current

    async def _check_logged(self) -> None:
        try:
            await self.check_once()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("instance health check failed")
        finally:
            self._current = None
            self._last_ended = time.monotonic()

    async def close(self) -> None:
        if self._current is not None:
            self._current.cancel()
            await asyncio.wait({self._current})
        await self.probe.close()

    async def _readmit_logged(self, instance: Instance) -> None:
        try:
            await self._readmit(instance)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("readmission of instance %s failed", instance.name)
