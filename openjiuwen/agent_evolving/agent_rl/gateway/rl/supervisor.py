"""Supervision of the RL Service child (CONTRACT §3.3 "Supervision", service start/stop/status; §2.1 process).

The gateway spawns `onlineRL.command + ["--config", onlineRL.configPath]` in its own process group, with the
gateway's environment plus a fresh random `RL_SERVICE_TOKEN`, and a parent-death signal (SIGKILL) so the child
never outlives the gateway, even when the gateway itself is SIGKILLed. Readiness is `GET {endpoint}/health` = 200.
Only the process this class spawned (and its process group) is ever signalled, never anything found by name.

Concurrency: one event loop; `start` and `stop` are serialized by a lock, and the exit watcher only makes
synchronous state changes before it calls `on_exit`, so it never needs the lock.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import logging
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

import httpx

from ...common.private_files import make_private_dirs, private_opener
from ...common.wire import env as wire_env
from ...common.wire import routes as rl_routes

log = logging.getLogger("openjiuwen.agent_rl.gateway.supervisor")



class ServiceStatus(StrEnum):
    """The RL Service child as `GET /v1/rl/service` reports it (CONTRACT §3.3)."""

    STOPPED = "stopped"
    RUNNING = "running"
    FAILED = "failed"  # exited without a stop request, or never became healthy: `failure_reason` says why


RUNNING, STOPPED, FAILED = ServiceStatus.RUNNING, ServiceStatus.STOPPED, ServiceStatus.FAILED
PR_SET_PDEATHSIG = 1
PARENT_GONE_EXIT_CODE = 70  # same code as the service's own watchdog
HEALTH_FIRST_DELAY_S = 0.05  # poll pauses double from here up to the cap
HEALTH_MAX_DELAY_S = 0.5
HEALTH_REQUEST_TIMEOUT_S = 2.0
PROBE_TIMEOUT_S = 1.0  # the "is the endpoint already served?" check before a spawn
KILL_WAIT_S = 10.0  # after SIGKILL the kernel needs only a moment; bounded anyway
STDOUT_NAME = "rl-service.stdout.log"
STDERR_NAME = "rl-service.stderr.log"

OnExit = Callable[[str], "Awaitable[None] | None"]


class SupervisorError(RuntimeError):
    """The RL Service could not be started (or reached readiness); `status()` then says `failed` with the reason."""


def exit_description(returncode: int) -> str:
    """`exited with code 3` or `killed by signal SIGKILL` (asyncio reports a signal as a negative code)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    return f"exited with code {returncode}"


def _parent_death_hook() -> Callable[[], None] | None:
    """A `preexec_fn` that asks the kernel to SIGKILL the child when the thread that forked it dies (Linux).

    libc is resolved here, before the fork: the child then only makes the system call. `CDLL(None)` is the running
    program with libc in it, without `find_library`, which would run ldconfig in a subprocess.
    """
    if not sys.platform.startswith("linux"):
        return None  # the service's own 1 s getppid() watchdog still bounds its lifetime
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the gateway died between fork and prctl: nobody will signal us
            os._exit(PARENT_GONE_EXIT_CODE)

    return set_parent_death_signal


@dataclass
class _Child:
    proc: asyncio.subprocess.Process
    token: str
    exited: asyncio.Task[int]  # proc.wait(); waited on with asyncio.wait so no waiter can cancel it
    stop_requested: bool = False
    watcher: asyncio.Task[None] | None = None
    hook_encodings: frozenset[str] = frozenset()  # what its `/health` listed (`packed-v1`: the packed `:after`)


class RLSupervisor:
    """Starts, watches and stops one RL Service child process.

    :param command: argv prefix of the child (`onlineRL.command`); `["--config", config_path]` is appended.
    :param endpoint: the child's base URL (loopback); readiness is `GET {endpoint}/health` = 200.
    :param control_timeout_s: bound of readiness on start and of the graceful exit on stop.
    :param env: the environment the child inherits; None = this process's environment. `RL_SERVICE_TOKEN` is always
        replaced by a fresh random token per spawn.
    :param log_dir: where the child's stdout and stderr go (appended); None = discarded.
    :param on_exit: called with the reason when the child exits without a stop request (after the status is
        already `failed`); the gateway releases that service's session mappings and leases there.
    :param model_id: when given, the child is ready only if its `/health` names this model id (`onlineRL.modelId`);
        a child configured for another model fails the start.
    """

    def __init__(
        self,
        *,
        command: list[str],
        config_path: str,
        endpoint: str,
        control_timeout_s: float,
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        on_exit: OnExit | None = None,
        model_id: str | None = None,
    ) -> None:
        if not command or not all(isinstance(part, str) and part for part in command):
            raise ValueError("command must be a non-empty list of non-empty strings")
        if not control_timeout_s > 0:
            raise ValueError("control_timeout_s must be positive")
        self._argv = [*command, "--config", config_path]
        self._endpoint = endpoint.rstrip("/")
        self._control_timeout_s = control_timeout_s
        self._env = env
        self._log_dir = log_dir
        self._on_exit = on_exit
        self._model_id = model_id
        self._lock = asyncio.Lock()
        self._child: _Child | None = None
        self._starting: _Child | None = None  # spawned, not yet healthy
        self._status = STOPPED
        self._failure_reason: str | None = None

    # ------------------------------------------------------------------ state

    def status(self) -> dict[str, Any]:
        return {"status": self._status, "failure_reason": self._failure_reason}

    @property
    def running(self) -> bool:
        return self._status == RUNNING

    @property
    def token(self) -> str | None:
        """The bearer token of the running child (`Authorization: Bearer <token>`); None when none runs."""
        return self._child.token if self._child is not None and self._status == RUNNING else None

    def accepts_hook_encoding(self, name: str) -> bool:
        """Whether the running child listed `name` in its `/health` `hook_encodings` (a child that predates them,
        or an AIGW-era service, lists none: the gateway then sends JSON)."""
        child = self._child
        return child is not None and self._status == RUNNING and name in child.hook_encodings

    @property
    def internal_token(self) -> str | None:
        """The bearer token the gateway's internal routes require: the running child's, or that of the child being
        started (its start-up recovery reads and may activate the policy before it reports healthy). None when no
        child is alive: the internal routes are then closed."""
        starting = self._starting
        if starting is not None and not starting.exited.done():
            return starting.token
        return self.token

    @property
    def pid(self) -> int | None:
        """The pid (and process group id) of the current child; None when there is none."""
        return self._child.proc.pid if self._child is not None else None

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _set(self, status: ServiceStatus, reason: str | None = None) -> None:
        self._status = status
        self._failure_reason = reason

    # ------------------------------------------------------------------ start

    async def start(self) -> dict[str, Any]:
        """Spawn the child unless it runs, and wait for `/health` = 200 within `control_timeout_s`.

        Idempotent: a running child is left alone and the same status returned.
        :raises SupervisorError: the child could not be spawned, exited, or was not healthy in time; it has been
            killed (its whole process group) and the status is `failed` with the reason.
        """
        async with self._lock:
            child = self._child
            if child is not None and not child.exited.done() and self._status == RUNNING:
                return self.status()
            if child is not None:  # it died and the watcher may still be reporting it: let it finish first
                await self._settle_watcher(child)
                self._child = None
            await self._spawn_until_healthy()
            return self.status()

    async def _spawn_until_healthy(self) -> None:
        async with httpx.AsyncClient(trust_env=False) as client:  # loopback: never through an HTTP proxy
            if await self._endpoint_taken(client):
                reason = f"{self._endpoint} is already served by another process; not starting a second one"
                self._set(FAILED, reason)
                raise SupervisorError(reason)
            child = await self._spawn()
            self._starting = child
            try:
                await self._wait_healthy(client, child)
            except BaseException as exc:  # incl. cancellation: a half-started child must not be left behind
                reason = str(exc) if isinstance(exc, SupervisorError) else "start was interrupted"
                self._child = None
                self._starting = None
                self._set(FAILED, reason)  # before the await: a second cancellation must not skip it
                log.error("RL Service start failed: %s", reason)
                await asyncio.shield(self._kill(child))
                raise
            self._starting = None
        self._child = child
        self._set(RUNNING)
        child.watcher = asyncio.create_task(self._watch(child), name=f"rl-service-watch:{child.proc.pid}")
        log.info("RL Service running (pid %d)", child.proc.pid)

    async def _endpoint_taken(self, client: httpx.AsyncClient) -> bool:
        try:
            await client.get(self._endpoint + rl_routes.HEALTH.path, timeout=PROBE_TIMEOUT_S)
        except httpx.ConnectError:
            return False  # nobody listens: the port is ours to take
        except httpx.TransportError:
            return True  # something accepted the connection but did not answer
        return True

    def _child_env(self, token: str) -> dict[str, str]:
        # Inheriting the gateway's environment is the contract (§3.1: ONLINE_RL_*, CUDA_VISIBLE_DEVICES, …).
        env = dict(os.environ if self._env is None else self._env)
        env[wire_env.SERVICE_TOKEN] = token
        return env

    def _open_logs(self) -> tuple[IO[bytes] | int, IO[bytes] | int]:
        if self._log_dir is None:
            return subprocess.DEVNULL, subprocess.DEVNULL
        # The child's output may quote captured text: 0600 files, a new directory 0700.
        make_private_dirs(self._log_dir)
        out = open(self._log_dir / STDOUT_NAME, "ab", opener=private_opener)
        try:
            err = open(self._log_dir / STDERR_NAME, "ab", opener=private_opener)
        except OSError:
            out.close()
            raise
        return out, err

    async def _spawn(self) -> _Child:
        token = secrets.token_urlsafe(32)
        try:
            stdout, stderr = await asyncio.to_thread(self._open_logs)
        except OSError as exc:
            reason = f"cannot open the RL Service log files in {self._log_dir}: {exc.strerror or type(exc).__name__}"
            self._set(FAILED, reason)
            raise SupervisorError(reason) from None
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv,
                env=self._child_env(token),
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # own process group: stop and failure kill exactly this group
                preexec_fn=_parent_death_hook(),
            )
        except OSError as exc:  # e.g. the command does not exist or is not executable
            reason = f"cannot spawn the RL Service: {exc.strerror or type(exc).__name__}"
            self._set(FAILED, reason)
            raise SupervisorError(reason) from None
        finally:
            for handle in (stdout, stderr):
                if not isinstance(handle, int):
                    handle.close()  # the child holds its own copies
        exited = asyncio.create_task(proc.wait(), name=f"rl-service-wait:{proc.pid}")
        log.info("RL Service spawned (pid %d)", proc.pid)
        return _Child(proc=proc, token=token, exited=exited)

    def _where_to_look(self) -> str:
        return f"; see {self._log_dir / STDERR_NAME}" if self._log_dir is not None else ""

    def _check_model(self, health: dict[str, Any]) -> None:
        if self._model_id is None:
            return
        served = health.get("model_id")
        if served != self._model_id:
            raise SupervisorError(f"the RL Service serves model {served!r} but onlineRL.modelId is "
                                  f"{self._model_id!r}; set both to the same model id")

    async def _wait_healthy(self, client: httpx.AsyncClient, child: _Child) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._control_timeout_s
        url = self._endpoint + rl_routes.HEALTH.path
        delay = HEALTH_FIRST_DELAY_S
        while True:
            if child.exited.done():  # fail fast: no point waiting for a process that is gone
                raise SupervisorError(
                    f"the RL Service {exit_description(child.exited.result())} during startup{self._where_to_look()}"
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise SupervisorError(
                    f"the RL Service was not healthy within {self._control_timeout_s:g} s{self._where_to_look()}"
                )
            try:
                resp = await client.get(url, timeout=min(HEALTH_REQUEST_TIMEOUT_S, remaining))
                if resp.status_code == 200 and not child.exited.done():
                    health = _health_body(resp)
                    self._check_model(health)
                    child.hook_encodings = _hook_encodings(health)
                    return
            except httpx.TransportError:
                pass  # not listening yet, or still starting up
            # Sleep, but wake at once if the child exits.
            await asyncio.wait({child.exited}, timeout=max(0.0, min(delay, deadline - loop.time())))
            delay = min(delay * 2, HEALTH_MAX_DELAY_S)

    # ------------------------------------------------------------------ exit watcher

    async def _watch(self, child: _Child) -> None:
        await asyncio.wait({child.exited})
        if child.stop_requested or self._child is not child:
            return
        reason = f"the RL Service {exit_description(child.exited.result())}"
        self._child = None
        self._set(FAILED, reason)
        log.error("%s without a stop request", reason)
        self._killpg(child)  # its own children (trainer workers) must not outlive it
        if self._on_exit is None:
            return
        try:
            result = self._on_exit(reason)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("on_exit callback failed after the RL Service exited")

    async def _settle_watcher(self, child: _Child) -> None:
        """Let a watcher that is reporting an exit (and running `on_exit`) finish, within the control bound."""
        if child.watcher is not None and not child.watcher.done():
            await asyncio.wait({child.watcher}, timeout=self._control_timeout_s)

    # ------------------------------------------------------------------ stop

    def _killpg(self, child: _Child) -> None:
        # The group id is the child's pid (start_new_session). Only our own group: never anything found by name.
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGKILL)

    async def _kill(self, child: _Child) -> None:
        child.stop_requested = True
        self._killpg(child)
        if not child.exited.done():
            with suppress(ProcessLookupError):
                child.proc.kill()  # in case it left its group
        await asyncio.wait({child.exited}, timeout=KILL_WAIT_S)
        if not child.exited.done():
            log.error("RL Service pid %d did not exit %g s after SIGKILL", child.proc.pid, KILL_WAIT_S)

    async def stop(self, drain: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
        """Drain (the gateway's captures), SIGTERM the child, wait ≤ `control_timeout_s`, then SIGKILL its process
        group → `stopped`. Idempotent; also clears a `failed` status. A failing or hanging `drain` (bounded by
        `control_timeout_s` here; the gateway bounds it by its drain timeout first) never prevents the stop."""
        async with self._lock:
            child = self._child
            if child is not None and not child.exited.done():
                if drain is not None:
                    await self._drain(drain)
                # Set only now: an exit during the drain is a failure, reported (and released) by the watcher.
                child.stop_requested = True
                if not child.exited.done():
                    with suppress(ProcessLookupError):
                        child.proc.send_signal(signal.SIGTERM)  # the process we spawned, not its group
                    await asyncio.wait({child.exited}, timeout=self._control_timeout_s)
                    if not child.exited.done():
                        log.warning("RL Service did not exit within %g s of SIGTERM; killing its process group",
                                    self._control_timeout_s)
                await self._kill(child)  # also any straggler of its group
            if child is not None:
                await self._settle_watcher(child)
                if child.exited.done():
                    log.info("RL Service stopped (%s)", exit_description(child.exited.result()))
            self._child = None
            self._set(STOPPED)
            return self.status()

    async def _drain(self, drain: Callable[[], Awaitable[None]]) -> None:
        try:
            async with asyncio.timeout(self._control_timeout_s):
                await drain()
        except TimeoutError:
            log.warning("drain did not finish within %g s; stopping the RL Service anyway", self._control_timeout_s)
        except Exception:
            log.exception("drain failed; stopping the RL Service anyway")

    async def close(self) -> None:
        """Gateway shutdown: stop the child without draining."""
        await self.stop()


def _health_body(resp: httpx.Response) -> dict[str, Any]:
    """The child's `/health` answer as an object; {} for a body that is not one (a stand-in's empty 200)."""
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _hook_encodings(health: dict[str, Any]) -> frozenset[str]:
    listed = health.get("hook_encodings")
    return frozenset(x for x in listed if isinstance(x, str)) if isinstance(listed, list) else frozenset()
