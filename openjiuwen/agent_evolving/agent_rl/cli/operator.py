"""`openjiuwen-rl rl ...`: operator commands against a gateway's HMAC-signed control API (CONTRACT §3.2, §3.3).

    openjiuwen-rl rl service start|stop|status
    openjiuwen-rl rl task start --session S [--mode terminal|delayed_feedback] [--evaluation] [--capture-secret]
    openjiuwen-rl rl task stop|get|events ID
    openjiuwen-rl rl task reward ID VALUE
    openjiuwen-rl rl task list [--status S] [--lineage L] [--limit N] [--all]
    openjiuwen-rl rl train start [--lineage L] [--watch]
    openjiuwen-rl rl train list [--lineage L] [--limit N] [--all]
    openjiuwen-rl rl train watch|stop|get RUN_ID
    openjiuwen-rl rl lineage get|pause|resume [LINEAGE]
    openjiuwen-rl rl lineage list [--limit N] [--all]
    openjiuwen-rl rl lineage archive|restore LINEAGE
    openjiuwen-rl rl lineage delete LINEAGE [--remove-files] [--wait]
    openjiuwen-rl rl policy report [--lineage L]
    openjiuwen-rl rl rollout status|promote|rollback|pause|resume [--lineage L]
    openjiuwen-rl rl rollout events ROLLOUT_ID
    openjiuwen-rl rl lora status [MODEL]
    openjiuwen-rl rl lora delete MODEL
    openjiuwen-rl rl instance list
    openjiuwen-rl rl instance remove NAME
    openjiuwen-rl rl traj stats [--lineage L]
    openjiuwen-rl rl traj list [--status S] [--lineage L] [--limit N] [--all]
    openjiuwen-rl rl traj get ID
    openjiuwen-rl rl traj exclude --instance NAME
    openjiuwen-rl rl console url [--ttl SECONDS]

Every request is signed anew with the key of the key file: the gateway's (the operator key, `apiHmacKey`: every
command) or an agent's own (an agent key: `task start|stop|reward` only; `openjiuwen-rl keys add-agent` writes one).
Output is human-readable, one line per item, with every control character of the answers' text escaped (ESC as
`\\x1b`, a line break as `\\n`: captured text and ids come from agents and models and must not drive the operator's
terminal); `--json` prints the raw answers, exactly. Exit status: 0 on success; 1 for an error answer (its code and
message are printed), an unreachable gateway, or a watched run that failed or was canceled; 2 for a usage or key
problem. This is an edge: it reads its environment (see ENVIRONMENT below). Here: the commands and their parser;
the HTTP client is gateway_client.py, the human-readable output rendering.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from ..common.wire import routes
from ..common.policy_names import BASE_POLICY
from ..gateway.console.console_auth import DEFAULT_LOGIN_TTL_S, MAX_LOGIN_TTL_MS
from ..common.signing_keys import KeyFileError, SigningKey, decode_key, load_signing_key
from ..online.store.sample_status import ALL_SAMPLE_STATUSES
from ..online.training.run_records import TERMINAL_STATUSES
from .gateway_client import CliError, ErrorAnswer, GatewayClient, path_segment
from .rendering import (
    err,
    out,
    raw,
    run_line,
    show_events,
    show_instances,
    show_items,
    show_lineage,
    show_lineage_rows,
    show_lora,
    show_policies,
    show_rollout,
    show_rollout_record,
    show_run,
    show_run_rows,
    show_sample,
    show_service,
    show_stats,
    show_task,
    show_task_rows,
    show_task_started,
    step_line,
)

DEFAULT_URL = "http://127.0.0.1:8080"
URL_ENV = "OPENJIUWEN_RL_GATEWAY"
KEY_ENV = "OPENJIUWEN_RL_HMAC_KEY"
KEY_FILE_ENV = "OPENJIUWEN_RL_KEY_FILE"
MODEL_ENV = "OPENJIUWEN_RL_MODEL"
DEFAULT_TIMEOUT_S = 330.0  # above the gateway's production controlTimeout (300 s)
WATCH_MAX_ERRORS = 5  # consecutive unanswered polls before `train watch` gives up

ENVIRONMENT = f"""\
environment:
  {URL_ENV:<24} gateway base URL when --url is not given (else {DEFAULT_URL})
  {KEY_ENV:<24} the apiHmacKey string itself, when --key-file is not given
  {KEY_FILE_ENV:<24} key file, when neither of the above is set: the gateway's {{"apiHmacKey": ...}} or an agent's
  {"":<24} {{"agentKeyId": ..., "agentHmacKey": ...}}
  {MODEL_ENV:<24} default MODEL of `lora status`
"""










@dataclass
class Context:
    args: argparse.Namespace
    client: GatewayClient
    as_json: bool
    env: Mapping[str, str]
    sleep: Callable[[float], None]
    clock: Callable[[], float]

    def show(self, data: Any, human: Callable[[Any], None]) -> None:
        if self.as_json:
            raw(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        else:
            human(data)






























































# ---------------------------------------------------------------------------------------------- handlers


def _service(action: str) -> Callable[[Context], int]:
    method, path = {"start": routes.SERVICE_START, "stop": routes.SERVICE_STOP,
                    "status": routes.SERVICE_STATUS}[action].at()

    def handler(ctx: Context) -> int:
        ctx.show(ctx.client.request(method, path), show_service)
        return 0

    return handler


def _task_start(ctx: Context) -> int:
    body: dict[str, Any] = {"reward_mode": ctx.args.mode}
    if ctx.args.capture_secret:
        body["capture_secret"] = True
    if ctx.args.evaluation:
        body["evaluation"] = True
    task = ctx.client.request(*routes.TASK_START.at(), body=body,
                              headers={"X-Agent-Session-Id": ctx.args.session})
    ctx.show(task, show_task_started)
    return 0




def _task_stop(ctx: Context) -> int:
    ctx.show(ctx.client.request(*routes.TASK_STOP.at(ctx.args.id)), show_task)
    return 0


def _task_get(ctx: Context) -> int:
    ctx.show(ctx.client.request(*routes.TASK.at(ctx.args.id)), show_task)
    return 0


def _task_events(ctx: Context) -> int:
    ctx.show(ctx.client.request(*routes.TASK_EVENTS.at(ctx.args.id)), show_events)
    return 0


def _pages(ctx: Context, path: str, params: dict[str, Any]) -> dict[str, Any]:
    """One page, or every page with `--all`; a hint for the next page goes to stderr."""
    page = ctx.client.request("GET", path, params=params)
    items = list(page.get("items", []))
    while ctx.args.all and page.get("next_cursor"):
        page = ctx.client.request("GET", path, params={**params, "cursor": page["next_cursor"]})
        items += page.get("items", [])
    result = {"items": items, "next_cursor": page.get("next_cursor")}
    if not ctx.as_json and result["next_cursor"]:
        err(f"more: --cursor {result['next_cursor']} (or --all)")
    return result


def _page_params(ctx: Context) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": ctx.args.limit}
    if getattr(ctx.args, "status", None):
        params["status"] = ctx.args.status
    if ctx.args.cursor:
        params["cursor"] = ctx.args.cursor
    if getattr(ctx.args, "lineage", None):
        # Trajectories: absent = the default line, as before lineages; Tasks and runs: absent = every lineage's.
        params["lineage"] = ctx.args.lineage
    return params


def _task_list(ctx: Context) -> int:
    result = _pages(ctx, routes.TASK_LIST.fill(), _page_params(ctx))
    ctx.show(result, lambda r: show_task_rows(r["items"]))
    return 0


def _train_list(ctx: Context) -> int:
    result = _pages(ctx, routes.RUN_LIST.fill(), _page_params(ctx))
    ctx.show(result, lambda r: show_run_rows(r["items"]))
    return 0


def _train_events(ctx: Context) -> int:
    ctx.show(ctx.client.request(*routes.RUN_EVENTS.at(ctx.args.run_id)), show_events)
    return 0


def _policy_report(ctx: Context) -> int:
    params = {"lineage": ctx.args.lineage} if ctx.args.lineage else None
    ctx.show(ctx.client.request(*routes.POLICIES.at(), params=params), show_policies)
    return 0


def _lineage_list(ctx: Context) -> int:
    result = _pages(ctx, routes.LINEAGE_LIST.fill(), _page_params(ctx))
    ctx.show(result, lambda r: show_lineage_rows(r["items"]))
    return 0


def _task_reward(ctx: Context) -> int:
    answer = ctx.client.request(*routes.TASK_REWARD.at(ctx.args.id), body={"reward": ctx.args.value})
    ctx.show(answer, lambda a: out(f"task {ctx.args.id}: reward {ctx.args.value} recorded, "
                                    f"{a.get('sample_count')} sample(s) published"))
    return 0


def _train_start(ctx: Context) -> int:
    body = {"lineage": ctx.args.lineage} if ctx.args.lineage else None  # absent: the default lineage, as before
    run = ctx.client.request(*routes.RUN_START.at(), body=body)
    if ctx.args.watch:
        # The created run is the first state shown: a fast run may already have steps at the first poll.
        return _watch(ctx, run["training_run_id"], seen=run)
    ctx.show(run, show_run)
    return 0


def _train_watch(ctx: Context) -> int:
    return _watch(ctx, ctx.args.run_id)


def _train_stop(ctx: Context) -> int:
    ctx.show(ctx.client.request(*routes.RUN_STOP.at(ctx.args.run_id)), show_run)
    return 0


def _train_get(ctx: Context) -> int:
    ctx.show(ctx.client.request(*routes.RUN.at(ctx.args.run_id)), show_run)
    return 0






def _watch(ctx: Context, run_id: str, *, seen: dict[str, Any] | None = None) -> int:
    """Poll the run until it is terminal, printing each status/stage change and each new step's metrics.
    0 when it succeeded, 1 when it failed or was canceled (or watching had to give up). `seen`: a record of the run
    already in hand (the start answer), shown first."""
    interval_s, timeout_s = ctx.args.interval, ctx.args.watch_timeout
    deadline = ctx.clock() + timeout_s if timeout_s > 0 else None
    last_state: tuple[Any, Any] | None = None
    last_record: Any = None
    if seen is not None and seen.get("status") not in TERMINAL_STATUSES:
        raw(orjson.dumps(seen).decode()) if ctx.as_json else out(run_line(seen))
        last_state, last_record = (seen.get("status"), seen.get("stage")), seen
    steps_shown = 0
    failures = 0
    while True:
        try:
            run = ctx.client.request(*routes.RUN.at(run_id))
        except ErrorAnswer as exc:
            if exc.status < 500:  # unknown run, bad key: waiting does not help
                raise
            problem = str(exc)
        except CliError as exc:  # unreachable gateway
            problem = str(exc)
        else:
            problem = None
        if problem is not None:
            failures += 1
            err(f"warning: polling {run_id}: {problem}")
            if failures >= WATCH_MAX_ERRORS:
                raise CliError(f"gave up watching {run_id} after {failures} failed polls")
        else:
            failures = 0
            steps = (run.get("metrics") or {}).get("step_metrics") or []
            if ctx.as_json:
                if run != last_record:
                    raw(orjson.dumps(run).decode())
            else:
                for step in steps[steps_shown:]:
                    out(step_line(step))
                state = (run.get("status"), run.get("stage"))
                if state != last_state:
                    out(run_line(run))
                last_state = state
            last_record, steps_shown = run, len(steps)
            if run.get("status") in TERMINAL_STATUSES:
                return 0 if run["status"] == "succeeded" else 1
        if deadline is not None and ctx.clock() >= deadline:
            raise CliError(f"run {run_id} not finished after {timeout_s:g} s (it keeps running)")
        ctx.sleep(interval_s)


def _lora_status(ctx: Context) -> int:
    model = ctx.args.model or ctx.env.get(MODEL_ENV)
    if not model:
        raise CliError(f"name the model: rl lora status MODEL (or set {MODEL_ENV})", exit_code=2)
    ctx.show(ctx.client.request("GET", f"/v1/loras/{path_segment(model)}"), show_lora(model))
    return 0








def _rollout_status(ctx: Context) -> int:
    params = {"lineage": ctx.args.lineage} if ctx.args.lineage else None  # absent: the default line, as before
    ctx.show(ctx.client.request(*routes.ROLLOUT.at(), params=params), show_rollout)
    return 0


_ROLLOUT_ACTIONS = {"promote": routes.ROLLOUT_PROMOTE, "rollback": routes.ROLLOUT_ROLLBACK,
                    "pause": routes.ROLLOUT_PAUSE, "resume": routes.ROLLOUT_RESUME}
_LINEAGE_ACTIONS = {"get": routes.LINEAGE, "pause": routes.LINEAGE_PAUSE, "resume": routes.LINEAGE_RESUME,
                    "archive": routes.LINEAGE_ARCHIVE, "restore": routes.LINEAGE_RESTORE}


def _rollout(action: str) -> Callable[[Context], int]:
    def handler(ctx: Context) -> int:
        body = {"lineage": ctx.args.lineage} if ctx.args.lineage else None  # absent: the default line, as before
        ctx.show(ctx.client.request(*_ROLLOUT_ACTIONS[action].at(), body=body), show_rollout_record)
        return 0

    return handler


def _rollout_events(ctx: Context) -> int:
    ctx.show(ctx.client.request(*routes.ROLLOUT_EVENTS.at(ctx.args.rollout_id)), show_events)
    return 0


def _lineage(action: str) -> Callable[[Context], int]:
    def handler(ctx: Context) -> int:
        answer = ctx.client.request(*_LINEAGE_ACTIONS[action].at(ctx.args.lineage))
        ctx.show(answer, show_lineage)
        return 0

    return handler


def _lineage_delete(ctx: Context) -> int:
    """Ask for the deletion; with `--wait`, poll until the lineage is gone (404 `lineage_not_found`)."""
    answer = ctx.client.request(*routes.LINEAGE_DELETE.at(ctx.args.lineage), body={"remove_files": ctx.args.remove_files})
    ctx.show(answer, show_lineage)
    if not ctx.args.wait:
        return 0
    deadline = ctx.clock() + ctx.args.watch_timeout if ctx.args.watch_timeout > 0 else None
    while True:
        ctx.sleep(ctx.args.interval)
        try:
            ctx.client.request(*routes.LINEAGE.at(ctx.args.lineage))
        except ErrorAnswer as exc:
            if exc.status != 404:
                raise
            if not ctx.as_json:
                out(f"lineage {ctx.args.lineage} deleted")
            return 0
        if deadline is not None and ctx.clock() >= deadline:
            raise CliError(f"lineage {ctx.args.lineage} not deleted after {ctx.args.watch_timeout:g} s (the "
                           "deletion goes on)")


def _lora_activate(ctx: Context) -> int:
    record = ctx.client.request(*routes.LORA_ACTIVATE.at(), body={"lora_name": ctx.args.lora_name})
    ctx.show(record, show_rollout_record)
    return 0 if record.get("status") == "activated" else 1


def _lora_delete(ctx: Context) -> int:
    ctx.client.request("DELETE", f"/v1/loras/{path_segment(ctx.args.model)}")
    ctx.show({"model": ctx.args.model, "status": BASE_POLICY},
             lambda _: out(f"{ctx.args.model}: LoRA deactivated; new Tasks use the base model "
                            "(running Tasks keep their pinned version)"))
    return 0




def _instance_list(ctx: Context) -> int:
    ctx.show(ctx.client.request("GET", "/aigw/v1/instances"), show_instances)
    return 0


def _instance_remove(ctx: Context) -> int:
    # The name goes in the signed body: a signature cannot be moved to another instance.
    answer = ctx.client.request("POST", "/aigw/v1/unregister-instance", body={"name": ctx.args.name})
    ctx.show(answer, lambda a: out(f"instance {a.get('name')} removed: no new requests go there; requests in "
                                    "flight finish"))
    return 0


def _traj_stats(ctx: Context) -> int:
    params = {"lineage": ctx.args.lineage} if ctx.args.lineage else None  # absent: the default line, as before
    ctx.show(ctx.client.request(*routes.TRAJECTORY_STATS.at(), params=params), show_stats)
    return 0


def _traj_list(ctx: Context) -> int:
    result = _pages(ctx, routes.TRAJECTORY_LIST.fill(), _page_params(ctx))
    ctx.show(result, lambda r: show_items(r["items"]))
    return 0


def _traj_reward(ctx: Context) -> int:
    body = {"source": ctx.args.source, "score": ctx.args.score}
    answer = ctx.client.request(*routes.TRAJECTORY_REWARD.at(ctx.args.id), body=body)
    ctx.show(answer, lambda a: out(
        f"sample {ctx.args.id}: {ctx.args.source} {ctx.args.score:g} "
        f"{'recorded' if a.get('recorded') else 'already recorded'}; status {a.get('status')}, "
        f"score {(a.get('rewards') or {}).get('score')}"))
    return 0


def _traj_exclude(ctx: Context) -> int:
    answer = ctx.client.request(*routes.TRAJECTORY_EXCLUDE.at(), body={"instance": ctx.args.instance})
    ctx.show(answer, lambda a: out(
        f"instance {a.get('instance')} excluded: {a.get('excluded')} sample(s) moved to `excluded` now, later ones "
        f"are filed there too; {a.get('training')} already in the running Training Run stay with it (cancel the "
        f"run to exclude them as well); excluded instances: {', '.join(a.get('excluded_instances') or [])}"))
    return 0


def _traj_get(ctx: Context) -> int:
    ctx.show(ctx.client.request(*routes.TRAJECTORY.at(ctx.args.id)), show_sample)
    return 0


def _console_url(ctx: Context) -> int:
    ttl_s = ctx.args.ttl
    if not 0 < ttl_s * 1000 <= MAX_LOGIN_TTL_MS:
        raise CliError(f"--ttl must be between 1 and {MAX_LOGIN_TTL_MS // 1000} seconds", exit_code=2)
    expires_ms = time.time_ns() // 1_000_000 + int(ttl_s * 1000)
    url = ctx.client.console_login_url(expires_ms=expires_ms)
    expires_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires_ms / 1000))
    ctx.show({"url": url, "expires_at": expires_at},
             lambda d: (out(d["url"]), err(f"single use; open it before {d['expires_at']}")))
    return 0


# ---------------------------------------------------------------------------------------------- parsing


def _add_common(parser: argparse.ArgumentParser, *, leaf: bool) -> None:
    # On leaves the defaults are SUPPRESS, so an option given before the command is not overwritten.
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if leaf else value

    parser.add_argument("--url", default=default(None),
                        help=f"gateway base URL (default ${URL_ENV} or {DEFAULT_URL})")
    parser.add_argument("--key-file", default=default(None),
                        help=f"the gateway's key file (operator) or an agent's key file (default ${KEY_ENV}, then "
                             f"${KEY_FILE_ENV})")
    parser.add_argument("--json", action="store_true", default=default(False),
                        help="print the raw JSON answer, exactly (human-readable output escapes control characters)")
    parser.add_argument("--timeout", type=float, default=default(DEFAULT_TIMEOUT_S),
                        help=f"seconds per request (default {DEFAULT_TIMEOUT_S:g})")


def _add_page_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=int, default=100, help="page size, 1..1000 (default 100)")
    parser.add_argument("--cursor", help="continue after a previous page")
    parser.add_argument("--all", action="store_true", help="follow next_cursor to the last page")


def _add_watch_options(parser: argparse.ArgumentParser, until: str = "the run ends") -> None:
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between polls (default 1)")
    parser.add_argument("--watch-timeout", type=float, default=0.0,
                        help=f"give up watching after this many seconds (default 0: wait until {until})")


class _Commands:
    """The `rl` parser's GROUP ACTION tree: every leaf takes the common options and names its handler."""

    def __init__(self, groups: argparse._SubParsersAction) -> None:
        self.groups = groups
        self.common = argparse.ArgumentParser(add_help=False)
        _add_common(self.common, leaf=True)

    def group(self, name: str, help_text: str) -> argparse._SubParsersAction:
        sub = self.groups.add_parser(name, help=help_text, description=help_text)
        return sub.add_subparsers(dest="action", metavar="ACTION", required=True)

    def leaf(self, actions: argparse._SubParsersAction, name: str, help_text: str,
             handler: Callable[[Context], int]) -> argparse.ArgumentParser:
        p = actions.add_parser(name, parents=[self.common], help=help_text, description=help_text,
                               epilog=ENVIRONMENT, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(handler=handler)
        return p


def _add_service_commands(c: _Commands) -> None:
    service = c.group("service", "start, stop or inspect the RL Service child of the gateway")
    c.leaf(service, "start", "start the RL Service (idempotent; waits until it is healthy)", _service("start"))
    c.leaf(service, "stop", "drain captures and stop the RL Service (idempotent)", _service("stop"))
    c.leaf(service, "status", "running, stopped or failed (with the reason)", _service("status"))


def _add_task_commands(c: _Commands) -> None:
    task = c.group("task", "start, stop, reward and inspect RL Tasks")
    p = c.leaf(task, "start", "start (or reuse) the Task of an agent session", _task_start)
    p.add_argument("--session", required=True, help="the agent's X-Agent-Session-Id")
    p.add_argument("--mode", choices=("terminal", "delayed_feedback"), default="terminal",
                   help="reward mode (default terminal)")
    p.add_argument("--capture-secret", action="store_true",
                   help="ask for a capture secret (printed once): the session's calls are captured only when they "
                        "carry it in X-Agent-Capture-Secret, so knowing the session id alone is not enough")
    p.add_argument("--evaluation", action="store_true",
                   help="an evaluation Task: its samples count in the per-version evaluation (`policy report`) but "
                        "no Training Run ever claims them")
    c.leaf(task, "stop", "drain in-flight captures and finalize the Task", _task_stop).add_argument("id")
    c.leaf(task, "get", "the Task record", _task_get).add_argument("id")
    c.leaf(task, "events", "the Task timeline", _task_events).add_argument("id")
    p = c.leaf(task, "list", "Tasks newest first", _task_list)
    p.add_argument("--status", choices=("active", "finalized", "aborted"), help="one status only")
    p.add_argument("--lineage", help="this lineage's Tasks only (`default` too; absent: every lineage's)")
    _add_page_options(p)
    p = c.leaf(task, "reward", "the terminal reward of a finalized Task (publishes its samples)", _task_reward)
    p.add_argument("id")
    p.add_argument("value", type=float, help="a number between 0 and 1")


def _add_train_commands(c: _Commands) -> None:
    train = c.group("train", "start, watch and stop Training Runs")
    p = c.leaf(train, "start", "start a Training Run (or return the active one)", _train_start)
    p.add_argument("--watch", action="store_true", help="then follow it like `train watch`")
    p.add_argument("--lineage", help="train this lineage's line (default: the default lineage)")
    _add_watch_options(p)
    p = c.leaf(train, "watch", "follow a run until it ends; exit 1 when it failed or was canceled", _train_watch)
    p.add_argument("run_id")
    _add_watch_options(p)
    c.leaf(train, "stop", "cancel a run (returns once it settled)", _train_stop).add_argument("run_id")
    c.leaf(train, "get", "the run record", _train_get).add_argument("run_id")
    c.leaf(train, "events", "the run timeline", _train_events).add_argument("run_id")
    p = c.leaf(train, "list", "Training Runs newest first", _train_list)
    p.add_argument("--lineage", help="this lineage's runs only (`default` too; absent: every lineage's)")
    _add_page_options(p)


def _add_policy_commands(c: _Commands) -> None:
    policy = c.group("policy", "per-version evaluation of the trained policies")
    c.leaf(policy, "report", "Tasks, samples, reward with its confidence interval, sources, judge agreement, tokens "
                             "and latency per version, and the latest version against its parent",
           _policy_report).add_argument("--lineage", help="base and this lineage's versions only")


def _add_rollout_commands(c: _Commands) -> None:
    rollout = c.group("rollout", "the canary of a new version: status, promote, roll back, pause (docs/rollout.md)")
    line_help = "this lineage's line (default: the default lineage)"
    c.leaf(rollout, "status", "the rollout mode, the current rollout with both arms, their reward intervals and the "
                              "decision with its reason, and the latest rollouts",
           _rollout_status).add_argument("--lineage", help=line_help)
    c.leaf(rollout, "promote", "promote the candidate now: it serves every new Task",
           _rollout("promote")).add_argument("--lineage", help=line_help)
    c.leaf(rollout, "rollback", "roll the candidate back now: every new Task gets the active version; Tasks pinned "
                                "to the candidate keep it until they end",
           _rollout("rollback")).add_argument("--lineage", help=line_help)
    c.leaf(rollout, "pause", "stop automatic decisions (new Tasks are still split)",
           _rollout("pause")).add_argument("--lineage", help=line_help)
    c.leaf(rollout, "resume", "resume automatic decisions",
           _rollout("resume")).add_argument("--lineage", help=line_help)
    c.leaf(rollout, "events", "the rollout timeline", _rollout_events).add_argument("rollout_id")


def _add_lineage_commands(c: _Commands) -> None:
    lineage = c.group("lineage", "a lineage's automatic training (its scheduler view, pause, resume; "
                                 "docs/training.md) and lifecycle (archive, restore, delete; docs/lineages.md)")
    for action, text in (("get", "paused or not, pending samples, oldest wait, and when the scheduler may start "
                                 "the next run"),
                         ("pause", "stop automatic Training Runs of the lineage (manual ones still start)"),
                         ("resume", "let the scheduler start the lineage's runs again")):
        c.leaf(lineage, action, text, _lineage(action)).add_argument(
            "lineage", nargs="?", default="default", help="the lineage (default: default)")
    _add_page_options(c.leaf(lineage, "list", "registered lineages newest first, with their line, state, pending "
                                              "samples and active run (docs/lineages.md)", _lineage_list))
    for action, text in (("archive", "no new Task or Training Run, its versions unloaded at the gateway; its data "
                                     "kept (refused while it has an active Task, run or rollout)"),
                         ("restore", "make an archived lineage live again, the version it served active again")):
        c.leaf(lineage, action, text, _lineage(action)).add_argument("lineage", help="the lineage (never default)")
    p = c.leaf(lineage, "delete", "unload its versions, remove its records in batches and leave the registry (the "
                                  "leader finishes it, also after a crash)", _lineage_delete)
    p.add_argument("lineage", help="the lineage (never default)")
    p.add_argument("--remove-files", action="store_true",
                   help="also remove its LoRA versions from the repository (default: kept)")
    p.add_argument("--wait", action="store_true", help="poll until the lineage is gone")
    _add_watch_options(p, "it is gone")


def _add_lora_commands(c: _Commands) -> None:
    lora = c.group("lora", "inspect or roll back the active LoRA of a model")
    c.leaf(lora, "activate", "activate any published version (<model>:vN) for every new Task, through the RL "
                             "Service so that its records stay true; pinned Tasks keep theirs",
           _lora_activate).add_argument("lora_name", help="e.g. tiny:v3")
    c.leaf(lora, "status", "base, active or degraded, with the active LoRA and instance counts",
           _lora_status).add_argument("model", nargs="?", help=f"model id (default ${MODEL_ENV})")
    c.leaf(lora, "delete", "deactivate the LoRA: new Tasks use the base model, pinned Tasks keep theirs",
           _lora_delete).add_argument("model")


def _add_instance_commands(c: _Commands) -> None:
    instance = c.group("instance", "the vLLM instances behind the gateway: list them, remove a registered one")
    c.leaf(instance, "list", "every instance with its origin (static or registered), health and loaded adapters",
           _instance_list)
    c.leaf(instance, "remove", "remove a registered instance from routing (static ones live in the gateway config)",
           _instance_remove).add_argument("name")


def _add_traj_commands(c: _Commands) -> None:
    traj = c.group("traj", "trajectory samples: counters, listing, detail, external rewards")
    p = c.leaf(traj, "stats", "counters by status and source", _traj_stats)
    p.add_argument("--lineage", help="this lineage's line (default: the default lineage)")
    p = c.leaf(traj, "list", "sample summaries, oldest first per status", _traj_list)
    p.add_argument("--status", choices=[s.value for s in ALL_SAMPLE_STATUSES],
                   help="one status only")
    p.add_argument("--lineage", help="this lineage's line (default: the default lineage)")
    _add_page_options(p)
    c.leaf(traj, "get", "one sample with its token arrays and judge", _traj_get).add_argument("id")
    p = c.leaf(traj, "exclude", "keep every sample a vLLM instance served out of training, now and from now on "
                                "(its pending samples become `excluded`)", _traj_exclude)
    p.add_argument("--instance", required=True, help="the instance name (as `rl instance list` shows it)")
    p = c.leaf(traj, "reward", "attach a score of an external reward source (needs a reward policy; "
                               "docs/rewards.md)", _traj_reward)
    p.add_argument("id", help="the sample (trajectory) id")
    p.add_argument("source", help="an external source of the service's reward_policy")
    p.add_argument("score", type=float, help="a number between 0 and 1")


def _add_console_commands(c: _Commands) -> None:
    console = c.group("console", "the gateway's read-only web console")
    p = c.leaf(console, "url", "print a single-use login link for the web console (signed here; no request is "
                               "sent)", _console_url)
    p.add_argument("--ttl", type=float, default=float(DEFAULT_LOGIN_TTL_S),
                   help=f"seconds the link stays valid (default {DEFAULT_LOGIN_TTL_S}, at most "
                        f"{MAX_LOGIN_TTL_MS // 1000})")


# The command groups in the order `--help` lists them.
_COMMAND_GROUPS: tuple[Callable[[_Commands], None], ...] = (
    _add_service_commands, _add_task_commands, _add_train_commands, _add_policy_commands, _add_rollout_commands,
    _add_lineage_commands, _add_lora_commands, _add_instance_commands, _add_traj_commands, _add_console_commands,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openjiuwen-rl rl", description="Operate online RL through a gateway's signed control API.",
        epilog=ENVIRONMENT, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(parser, leaf=False)
    commands = _Commands(parser.add_subparsers(dest="group", metavar="GROUP", required=True))
    for add in _COMMAND_GROUPS:
        add(commands)
    return parser


def _key(key_file: str | None, env: Mapping[str, str]) -> SigningKey:
    path = key_file
    if path is None:
        text = env.get(KEY_ENV, "")
        if text:
            try:
                return SigningKey(decode_key(text))
            except ValueError as exc:
                raise CliError(f"{KEY_ENV}: {exc}", exit_code=2) from None
        path = env.get(KEY_FILE_ENV) or None
    if path is None:
        raise CliError(f"no HMAC key: pass --key-file FILE, or set {KEY_ENV} or {KEY_FILE_ENV}", exit_code=2)
    try:
        return load_signing_key(path)
    except KeyFileError as exc:
        raise CliError(str(exc), exit_code=2) from None


def main(
    argv: list[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run one operator command; `env`, `transport`, `sleep` and `clock` are for tests."""
    args = build_parser().parse_args(argv)
    env = os.environ if env is None else env
    try:
        key = _key(args.key_file, env)
        url = args.url or env.get(URL_ENV) or DEFAULT_URL
        client = GatewayClient(url, key, timeout_s=args.timeout, transport=transport)
        try:
            return args.handler(Context(args, client, args.json, env, sleep, clock))
        finally:
            client.close()
    except CliError as exc:
        err(f"error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
