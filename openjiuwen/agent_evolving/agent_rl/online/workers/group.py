"""The RL Service as a group of worker processes on one port (`workers: N` > 1).

The process the gateway starts (and supervises, signals and kills as one unit: its process group) becomes the
group's parent. It binds the service port once and starts N workers, each `python -m ...online.service --config
FILE` with `ONLINE_RL_WORKER` set, inheriting the bound socket: the kernel hands each new connection to one of the
workers that accept on it. The parent serves nothing itself. It

- restarts a worker that exits while the group runs (after a pause that grows while a slot keeps failing), once it
  reaped it; first it tells Redis that process is dead (`lease.bury`: out of the heartbeat set, the lease dropped if
  it held it), so the claims it held are taken over and a new leader elected without waiting out a TTL;
- fails the whole start, as a lone service would, when a worker exits before any worker of the group was ready;
- on SIGTERM (or SIGINT) stops every worker with SIGTERM and waits for them: each drains its requests; the leader
  then finishes the active Tasks once the others left (leader_duties.py `leave_office`); it exits 0 when every worker
  stopped cleanly (or died of that SIGTERM while still starting, before it served anything);
- dies with the gateway (the parent-death watchdog), and its workers die with it (their own watchdog).

Workers report readiness through a pipe (one line `<slot>`), and their metrics go to a private directory that
`GET /metrics` on any worker aggregates (prometheus_client's multiprocess mode, metrics.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from ..faults import CRASH_AT_ENV
from .lease import bury

log = logging.getLogger("openjiuwen.agent_rl.online.workers")

WORKER_ENV = "ONLINE_RL_WORKER"  # `<boot>:<slot>:<count>:<listen fd>:<ready fd>`, set by the group only
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
MODULE = "openjiuwen.agent_evolving.agent_rl.online.service"
STOP_TIMEOUT_S = 45.0  # a worker's graceful stop (30 s) plus the leader's wait for the others
FIRST_BACKOFF_S = 0.2
MAX_BACKOFF_S = 10.0
STABLE_AFTER_S = 30.0  # a worker that ran this long resets its slot's backoff
BURY_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class WorkerSlot:
    """What a worker process reads from `ONLINE_RL_WORKER`."""

    boot: str
    slot: int
    count: int
    listen_fd: int
    ready_fd: int

    def encode(self) -> str:
        return f"{self.boot}:{self.slot}:{self.count}:{self.listen_fd}:{self.ready_fd}"

    @classmethod
    def decode(cls, raw: str) -> "WorkerSlot":
        boot, slot, count, listen_fd, ready_fd = raw.split(":")
        return cls(boot, int(slot), int(count), int(listen_fd), int(ready_fd))


def exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class WorkerGroup:
    def __init__(self, *, config_path: str, host: str, port: int, count: int, redis_url: str) -> None:
        self._config_path = config_path
        self._redis_url = redis_url
        self._host, self._port, self._count = host, port, count
        self._boot = secrets.token_hex(6)
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._waits: dict[int, asyncio.Task[int]] = {}
        self._started_at: dict[int, float] = {}
        self._backoff: dict[int, float] = {}
        self._was_ready = False  # sticky: once any worker served, a later death is a restart, never a failed start
        self._stopping = asyncio.Event()
        self._sock: socket.socket | None = None
        self._ready_r = self._ready_w = -1
        self._metrics_dir = ""

    def run(self) -> int:
        """Run until stopped; 0 when every worker stopped cleanly, 1 when the group could not start."""
        return asyncio.run(self._run())

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            self._open()
        except OSError as exc:
            log.error("cannot bind %s:%d: %s", self._host, self._port, exc)
            return 1
        try:
            loop.add_reader(self._ready_r, self._read_ready)
            for slot in range(self._count):
                await self._spawn(slot)
            log.info("RL Service worker group %s: %d workers on %s:%d", self._boot, self._count, self._host,
                     self._port)
            return await self._supervise()
        finally:
            loop.remove_reader(self._ready_r)
            self._close()

    def _open(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        # Not listening here: the first worker to start serving calls listen(), so until a worker is ready a
        # client is refused at once rather than left waiting in a backlog nobody accepts from.
        sock.set_inheritable(True)
        self._sock = sock
        self._ready_r, self._ready_w = os.pipe()
        os.set_inheritable(self._ready_w, True)
        os.set_blocking(self._ready_r, False)
        self._metrics_dir = tempfile.mkdtemp(prefix="rl-service-metrics-")  # 0700

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for fd in (self._ready_r, self._ready_w):
            if fd >= 0:
                os.close(fd)
        self._ready_r = self._ready_w = -1
        if self._metrics_dir:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)

    def _read_ready(self) -> None:
        try:
            data = os.read(self._ready_r, 4096)
        except BlockingIOError:
            return
        for line in data.decode(errors="replace").split():
            if line.isdigit():
                if not self._was_ready:
                    log.info("RL Service worker group ready")
                self._was_ready = True

    async def _spawn(self, slot: int, *, replacement: bool = False) -> None:
        assert self._sock is not None
        env = dict(os.environ)
        if replacement:  # as a lone service restarted after an injected crash, its replacement runs without it
            env.pop(CRASH_AT_ENV, None)  # chaos tests only: a fault crashes the first workers, not their heirs
        env[WORKER_ENV] = WorkerSlot(self._boot, slot, self._count, self._sock.fileno(), self._ready_w).encode()
        env[METRICS_DIR_ENV] = self._metrics_dir
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", MODULE, "--config", self._config_path, env=env, stdin=asyncio.subprocess.DEVNULL,
            pass_fds=(self._sock.fileno(), self._ready_w),
        )
        self._procs[slot] = proc
        self._started_at[slot] = time.monotonic()
        self._waits[slot] = asyncio.create_task(proc.wait(), name=f"rl-worker-{slot}")
        log.info("worker %d started (pid %d)", slot, proc.pid)

    async def _supervise(self) -> int:
        stop = asyncio.create_task(self._stopping.wait())
        restarts: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                waiting = {stop, *self._waits.values(), *restarts.values()}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if stop in done:
                    for task in restarts.values():
                        task.cancel()
                    return await self._stop_all()
                for slot, task in list(restarts.items()):
                    if task in done:
                        del restarts[slot]
                for slot, wait in list(self._waits.items()):
                    if wait not in done:
                        continue
                    del self._waits[slot]
                    proc = self._procs.pop(slot)
                    code = wait.result()
                    self._mark_dead(proc.pid)
                    await self._bury(slot, proc.pid)
                    if not self._was_ready:
                        log.error("worker %d %s before the group was ready; stopping the RL Service", slot,
                                  exit_description(code))
                        await self._stop_all()
                        return 1
                    delay = self._next_backoff(slot)
                    log.error("worker %d (pid %d) %s; restarting it in %.1f s", slot, proc.pid,
                              exit_description(code), delay)
                    restarts[slot] = asyncio.create_task(self._restart(slot, delay), name=f"rl-worker-restart-{slot}")
        finally:
            stop.cancel()

    def _next_backoff(self, slot: int) -> float:
        ran = time.monotonic() - self._started_at.get(slot, 0.0)
        previous = self._backoff.get(slot, 0.0)
        delay = FIRST_BACKOFF_S if ran >= STABLE_AFTER_S or previous == 0.0 else min(previous * 2, MAX_BACKOFF_S)
        self._backoff[slot] = delay
        return delay

    async def _restart(self, slot: int, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self._stopping.is_set():
            await self._spawn(slot, replacement=True)

    async def _stop_all(self) -> int:
        """SIGTERM every worker, wait for them (bounded), SIGKILL what is left. 0 when all exited with 0."""
        if self._sock is not None:
            self._sock.close()  # once the workers close theirs, new connections are refused
            self._sock = None
        for proc in self._procs.values():
            if proc.returncode is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        waits = list(self._waits.values())
        if waits:
            _, pending = await asyncio.wait(waits, timeout=STOP_TIMEOUT_S)
            for slot, wait in self._waits.items():
                if wait in pending:
                    log.error("worker %d did not stop within %.0f s; killing it", slot, STOP_TIMEOUT_S)
                    try:
                        self._procs[slot].kill()
                    except ProcessLookupError:
                        pass
            if pending:
                await asyncio.wait(pending, timeout=10.0)
        codes = [w.result() for w in waits if w.done()]
        self._waits.clear()
        self._procs.clear()
        # A worker still starting when the SIGTERM came dies of it before it can handle it: it served nothing.
        clean = len(codes) == len(waits) and all(code in (0, -signal.SIGTERM) for code in codes)
        log.info("RL Service worker group stopped (%s)", "clean" if clean else f"exit codes {codes}")
        return 0 if clean else 1

    async def _bury(self, slot: int, pid: int) -> None:
        """Best-effort (Redis may be down): otherwise the dead process's heartbeat entry and lease expire by TTL."""
        member = f"{self._boot}:{slot}:{pid}"
        try:
            async with Redis.from_url(self._redis_url, socket_timeout=BURY_TIMEOUT_S,
                                      socket_connect_timeout=BURY_TIMEOUT_S) as redis:
                if await bury(redis, member):
                    log.info("worker %d held the leader lease; released it for the next leader", slot)
        except (RedisError, OSError) as exc:
            log.warning("could not tell Redis that worker %d (pid %d) is dead: %s", slot, pid, type(exc).__name__)

    def _mark_dead(self, pid: int) -> None:
        """A dead worker's live gauges leave the aggregate; its counters stay (they never go backwards)."""
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self._metrics_dir)
        except Exception:  # best-effort: a missing file is no error
            pass
