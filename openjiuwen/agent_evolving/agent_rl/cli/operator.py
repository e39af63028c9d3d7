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
problem. This is an edge: it reads its environment (see ENVIRONMENT below).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from ..common.control_chars import escape_controls
from ..common.policy_names import BASE_POLICY
from ..gateway.console_auth import DEFAULT_LOGIN_TTL_S, MAX_LOGIN_TTL_MS, login_token
from ..common.hmac_signing import HmacAuth
from ..common.signing_keys import KeyFileError, SigningKey, decode_key, load_signing_key
from ..online.store.sample_status import ALL_SAMPLE_STATUSES
from ..online.training.run_records import TERMINAL_STATUSES, RunStatus

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


class CliError(Exception):
    """A failure to report as `error: <message>` with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ErrorAnswer(CliError):
    """A non-2xx answer: its status and the envelope's code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        hint = " (check the HMAC key, and that this machine's clock is within 300 s)" if status == 401 else ""
        super().__init__(f"{status} {code}: {message}{hint}")
        self.status = status
        self.code = code


def _q(segment: str) -> str:
    return quote(segment, safe="")  # an id is one path segment, whatever it holds


class GatewayClient:
    """Signed requests to one gateway; each answer is the decoded JSON (None for an empty 2xx body)."""

    def __init__(self, url: str, key: SigningKey, *, timeout_s: float,
                 transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self._key = key
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport, auth=HmacAuth(key))

    def close(self) -> None:
        self._http.close()

    def console_login_url(self, *, expires_ms: int) -> str:
        """The web console's single-use login link. The token sits in the fragment: browsers never send it, so no
        access log or proxy sees it."""
        if self._key.is_agent:
            raise CliError("the console login is signed with the operator key: use the gateway's key file",
                           exit_code=2)
        return f"{self.url}/console/login#token={login_token(self._key.key, expires_ms=expires_ms)}"

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        content = b"" if body is None else orjson.dumps(body)
        extra = {"content-type": "application/json"} if body is not None else {}
        extra.update(headers or {})
        try:
            resp = self._http.request(method, path, content=content, params=params, headers=extra)
        except httpx.TransportError as exc:
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise CliError(f"cannot reach the gateway at {self.url} ({detail})") from None
        if not resp.is_success:
            try:
                error = resp.json()["error"]
                code, message = str(error["code"]), str(error["message"])
            except (ValueError, KeyError, TypeError):
                code, message = "http_error", resp.text[:300] or resp.reason_phrase
            raise ErrorAnswer(resp.status_code, code, message)
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            raise CliError(f"{method} {path}: the {resp.status_code} answer is not JSON") from None


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
            _raw(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        else:
            human(data)


def _out(text: str = "") -> None:
    """One line of human-readable output, its control characters escaped (issue 28 item 6)."""
    print(escape_controls(text), flush=True)  # flushed per line: `train watch` is read live through pipes


def _raw(text: str) -> None:
    """`--json` output: the answer exactly as orjson writes it."""
    print(text, flush=True)


def _err(text: str) -> None:
    """A human-readable line on stderr (errors quote the gateway's messages), escaped like `_out`."""
    print(escape_controls(text), file=sys.stderr, flush=True)


def _fields(rows: Sequence[tuple[str, Any]]) -> None:
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        _out(f"{label:<{width}}  {'-' if value is None or value == '' else value}")


# ---------------------------------------------------------------------------------------------- human formats


def _show_service(data: dict[str, Any]) -> None:
    reason = data.get("failure_reason")
    _out(f"RL Service: {data.get('status')}" + (f" ({reason})" if reason else ""))


def _show_task(task: dict[str, Any]) -> None:
    status = task.get("status")
    if task.get("finish_reason"):
        status = f"{status} ({task['finish_reason']})"
    _fields([
        ("task", task.get("rl_task_id")),
        ("session", task.get("agent_session_id")),
        ("status", status),
        ("reward mode", task.get("reward_mode")),
        ("evaluation", "yes (never trained on)" if task.get("evaluation") else "no"),
        ("policy", f"{task.get('policy_lora_name')} (model {task.get('policy_model')})"),
        ("created", task.get("created_at")),
        ("finished", task.get("finished_at")),
    ])


def _show_events(data: dict[str, Any]) -> None:
    for event in data.get("items", []):
        _out(f"{event.get('at')}  {event.get('type'):<22} {orjson.dumps(event.get('data')).decode()}")


def _trigger_text(trigger: Any) -> str | None:
    """`manual`, or `auto (max_wait_seconds: 5 eligible of 5 pending, oldest waited 61.2 s)`."""
    if not isinstance(trigger, dict):
        return None
    if trigger.get("kind") != "auto":
        return str(trigger.get("kind") or "manual")
    return (f"auto ({trigger.get('reason')}: {trigger.get('eligible_samples')} eligible of "
            f"{trigger.get('pending_samples')} pending, oldest waited {trigger.get('oldest_wait_seconds')} s)")


def _show_lineage(data: dict[str, Any]) -> None:
    view = data.get("scheduler") or {}
    policy = data.get("training_policy") or {}
    state = "eligible now" if view.get("eligible") else "not eligible"
    _fields([
        ("lineage", f"{data.get('lineage')} (line {data.get('line')})"),
        ("state", _lifecycle(data)),
        ("automatic", "on" if policy.get("auto") else "off (manual runs only)"),
        ("paused", f"yes, since {data.get('paused_at')}" if data.get("paused") else "no"),
        ("pending", f"{view.get('pending_samples')} ({view.get('eligible_samples')} eligible)"),
        ("oldest wait", None if view.get("oldest_wait_seconds") is None else f"{view['oldest_wait_seconds']} s"),
        ("active run", view.get("active_run")),
        ("last run end", view.get("last_run_ended_at")),
        ("scheduler", f"{state} ({view.get('reason')})"),
        ("eligible from", view.get("eligible_since")),
        ("next eligible", view.get("next_eligible_at")),
        ("fair share", f"weight {policy.get('weight')}, tag {view.get('fair_share_tag')}"
         if policy.get("weight") is not None else None),
    ])


def _lifecycle(data: dict[str, Any]) -> str:
    state = str(data.get("state") or "live")
    if state == "archived":
        return (f"archived since {data.get('archived_at')} (by {data.get('archived_by')}; a restore serves "
                f"{data.get('restores_to')} again)")
    if state == "deleting":
        files = "removed" if data.get("remove_files") else "kept"
        return f"being deleted since {data.get('deletion_started_at')} (repository files {files})"
    return state


def _freshness_text(fresh: Any) -> str | None:
    """`eligible → run 2.1 s, sample → policy p50 40 s / p95 71 s (activation)` (docs/training.md "Freshness")."""
    if not isinstance(fresh, dict):
        return None
    parts = []
    if fresh.get("eligible_wait_seconds") is not None:
        parts.append(f"eligible → run {fresh['eligible_wait_seconds']} s")
    latency = fresh.get("sample_to_policy_seconds")
    if isinstance(latency, dict):
        parts.append(f"sample → policy p50 {latency.get('p50')} s / p95 {latency.get('p95')} s "
                     f"({fresh.get('policy_via')})")
    return ", ".join(parts) or None


def _show_run(run: dict[str, Any]) -> None:
    metrics = run.get("metrics") or {}
    versions = ", ".join(f"{k}={v}" for k, v in (run.get("policy_versions") or {}).items())
    _fields([
        ("run", run.get("training_run_id")),
        ("status", f"{run.get('status')} (stage {run.get('stage')})"),
        ("samples", f"{run.get('sample_count')}" + (f" ({versions})" if versions else "")),
        ("lora", " ".join(x for x in (run.get("lora_name"), run.get("lora_path")) if x)),
        ("failure", run.get("failure_reason")),
        ("trigger", _trigger_text(run.get("trigger"))),
        ("freshness", _freshness_text(run.get("freshness"))),
        ("steps", metrics.get("steps")),
        ("sampling", _run_sampling_text(metrics.get("sampling"))),
        ("shaped", _counts_text(metrics.get("constraints"))),  # the run's samples per constraint kind
        ("timings", _timings_text(metrics.get("timings"))),
        ("created", run.get("created_at")),
        ("started", run.get("started_at")),
        ("finished", run.get("finished_at")),
    ])


def _show_lora(model: str) -> Callable[[dict[str, Any]], None]:
    def show(data: dict[str, Any]) -> None:
        active = data.get("active_lora") or {}
        instances = data.get("instances") or {}
        line = f"{model}: {data.get('status')}"
        if active:
            line += f" {active.get('lora_name')} ({active.get('lora_path')})"
        _out(f"{line}; instances ready {instances.get('ready', 0)}, failed {instances.get('failed', 0)}")

    return show


def _show_stats(stats: dict[str, Any]) -> None:
    by_status = ", ".join(f"{k} {v}" for k, v in (stats.get("by_status") or {}).items())
    by_source = ", ".join(f"{k} {v}" for k, v in (stats.get("by_source") or {}).items())
    _fields([
        ("total", stats.get("total")),
        ("by status", by_status),
        ("by source", by_source),
        ("stale", stats.get("stale")),
        ("expired unrewarded", stats.get("expired_unrewarded")),
        *_reward_rows(stats.get("rewards")),
        ("updated", stats.get("updated_at")),
    ])


def _reward_rows(rewards: Any) -> list[tuple[str, Any]]:
    """The reward-policy part of the stats (present only when the service has a reward policy)."""
    if not isinstance(rewards, dict):
        return []
    rows: list[tuple[str, Any]] = [
        ("rewards", f"{rewards.get('aggregation')}; waiting {rewards.get('waiting')}, "
                    f"dropped {rewards.get('dropped')}, next deadline {rewards.get('next_deadline_at') or '-'}"),
    ]
    for name, source in (rewards.get("sources") or {}).items():
        p50, p95 = source.get("late_p50_seconds"), source.get("late_p95_seconds")
        late = "-" if p50 is None else f"p50 {p50:g} s, p95 {p95:g} s"
        rows.append((f"  {name}", f"arrived {source.get('arrived')}, fallback {source.get('fallback')}, late {late}"))
    return rows


_LIST_COLUMNS = (("SAMPLE_ID", "sample_id"), ("STATUS", "status"), ("SOURCE", "source"),
                 ("SESSION", "session_id"), ("POLICY", "policy_version"), ("INSTANCE", "instance"),
                 ("SAMPLING", "sampling"), ("CREATED_AT", "created_at"))
# A sampling field shown only when it differs from vLLM's neutral value (common/sampling.py DEFAULTS).
_SAMPLING_SHOWN = (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0))


def _sampling_text(sampling: Any) -> str:
    """`T 0.7 top_p 0.9 [json_schema, penalties]` (the kinds of its constraints last); "-" for a sample without a
    record (a rail upload: drawn at the neutral defaults)."""
    if not isinstance(sampling, dict):
        return "-"
    parts = [f"T {sampling.get('temperature'):g}"] if isinstance(sampling.get("temperature"), (int, float)) else []
    for key, neutral in _SAMPLING_SHOWN:
        value = sampling.get(key)
        if isinstance(value, (int, float)) and value != neutral and not (key == "top_k" and value == -1):
            parts.append(f"{key} {value:g}")
    constraints = sampling.get("constraints")
    if isinstance(constraints, dict) and constraints:
        parts.append("[" + ", ".join(str(kind) for kind in constraints) + "]")
    return " ".join(parts) or "-"


def _constraints_text(sampling: Any) -> str | None:
    """Each constraint of a sample with its recorded details: `json_schema (name Answer, bytes 81, …); greedy`."""
    constraints = sampling.get("constraints") if isinstance(sampling, dict) else None
    if not isinstance(constraints, dict) or not constraints:
        return None
    parts = []
    for kind, details in constraints.items():
        shown = ", ".join(f"{k} {v}" for k, v in details.items()) if isinstance(details, dict) else ""
        parts.append(f"{kind} ({shown})" if shown else str(kind))
    return "; ".join(parts)


def _exclusion_text(exclusion: Any) -> str | None:
    """Why a sample is kept out of training: `excluded: constraint greedy` or `excluded: instance`."""
    if not isinstance(exclusion, dict):
        return None
    kinds = ", ".join(str(k) for k in exclusion.get("kinds") or [])
    return f"excluded: {exclusion.get('reason')}" + (f" {kinds}" if kinds else "")


def _counts_text(counts: Any) -> str | None:
    if not isinstance(counts, dict) or not counts:
        return None
    return ", ".join(f"{kind}×{n}" for kind, n in counts.items())


RUN_PHASES = ("load", "pi_old", "steps", "save", "publish")  # a Training Run's phases in the order they run


def _timings_text(timings: Any) -> str | None:
    """Where the run's time went (`metrics.timings`, seconds per phase), in the order the phases run."""
    if not isinstance(timings, dict):
        return None
    order = [name for name in RUN_PHASES if name in timings] + [name for name in timings if name not in RUN_PHASES]
    return ", ".join(f"{name} {_num(timings[name], '.1f')} s" for name in order)


def _run_sampling_text(report: Any) -> str | None:
    """The run's sampling report in one line: temperatures, truncated samples, captured vs recomputed logprobs."""
    if not isinstance(report, dict):
        return None
    temps = ", ".join(f"{t}×{n}" for t, n in (report.get("temperatures") or {}).items())
    return (f"T {temps or '-'}; truncated {report.get('truncated_samples')}; "
            f"|captured − recomputed| mean {_num(report.get('logprob_mismatch_mean'), '.2g')}, "
            f"max {_num(report.get('logprob_mismatch_max'), '.2g')}; "
            f"ratios clipped {_num(report.get('ratio_clipped_share'), '.1%')} ({report.get('correction')})"
            + (f"; constrained {report['constrained_samples']}" if report.get("constrained_samples") else "")
            + (f"; over {report['recomputed_samples']} recomputed samples" if "recomputed_samples" in report else ""))


def _show_items(items: list[dict[str, Any]]) -> None:
    _table([[_sampling_text(item.get(key)) if key == "sampling" else str(item.get(key) or "-")
             for _, key in _LIST_COLUMNS] for item in items],
           [title for title, _ in _LIST_COLUMNS])


def _table(rows: list[list[str]], titles: list[str]) -> None:
    widths = [max([len(title)] + [len(row[i]) for row in rows]) for i, title in enumerate(titles)]
    for row in [titles, *rows]:
        _out("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _show_task_rows(items: list[dict[str, Any]]) -> None:
    _table([[str(t.get("rl_task_id")), str(t.get("status")), str(t.get("finish_reason") or "-"),
             str(t.get("reward_mode")), str(t.get("policy_lora_name")), str(t.get("agent_session_id")),
             str(t.get("created_at"))] for t in items],
           ["TASK", "STATUS", "REASON", "MODE", "POLICY", "SESSION", "CREATED_AT"])


def _show_lineage_rows(items: list[dict[str, Any]]) -> None:
    _table([[str(x.get("lineage")), str(x.get("line")), str(x.get("state") or "live"), str(x.get("pending_samples")),
             str(x.get("active_run") or "-"), str(x.get("first_used_at"))] for x in items],
           ["LINEAGE", "LINE", "STATE", "PENDING", "ACTIVE_RUN", "FIRST_USED_AT"])


def _show_run_rows(items: list[dict[str, Any]]) -> None:
    _table([[str(r.get("training_run_id")), str(r.get("status")), str(r.get("stage")), str(r.get("sample_count")),
             str(r.get("lora_name") or "-"), str(r.get("created_at"))] for r in items],
           ["RUN", "STATUS", "STAGE", "SAMPLES", "LORA", "CREATED_AT"])


def _num(value: Any, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def _show_policies(report: dict[str, Any]) -> None:
    rows = []
    for p in report.get("items", []):
        reward = p.get("reward") or {}
        ci = reward.get("ci95")
        latency = p.get("completion_latency_ms") or {}
        rows.append([
            str(p.get("policy_version")), str(p.get("parent_version") or "-"), str(p.get("tasks")),
            str(p.get("samples")), _num(reward.get("mean")), f"[{_num(ci[0])}, {_num(ci[1])}]" if ci else "-",
            ", ".join(f"{k} {v}" for k, v in (p.get("reward_sources") or {}).items()) or "-",
            _num(p.get("judge_agreement"), ".2f"), _num(p.get("tokens_per_completion"), ".1f"),
            _num(latency.get("p50"), ".0f"), _num(latency.get("p95"), ".0f"),
        ])
    _table(rows, ["VERSION", "PARENT", "TASKS", "SAMPLES", "REWARD", "CI95", "SOURCES", "AGREE", "TOKENS",
                  "P50_MS", "P95_MS"])
    evaluated = [p for p in report.get("items", []) if (p.get("evaluation") or {}).get("tasks")]
    if evaluated:
        _out("evaluation Tasks only (never trained on):")
        rows = []
        for p in evaluated:
            ev = p["evaluation"]
            reward = ev.get("reward") or {}
            ci = reward.get("ci95")
            rows.append([str(p.get("policy_version")), str(ev.get("tasks")), str(ev.get("samples")),
                         _num(reward.get("mean")), f"[{_num(ci[0])}, {_num(ci[1])}]" if ci else "-"])
        _table(rows, ["VERSION", "TASKS", "SAMPLES", "REWARD", "CI95"])
    comparison = report.get("comparison")
    if comparison:
        ci = comparison.get("ci95")
        _out(f"{comparison['latest']} vs {comparison['parent']}: reward {comparison['reward_delta']:+.3f}"
             + (f" (95% CI {ci[0]:+.3f} .. {ci[1]:+.3f})" if ci else ""))


def _show_sample(sample: dict[str, Any]) -> None:
    trajectory = sample.get("trajectory") or {}
    judge = sample.get("judge") or {}
    reply = str(trajectory.get("response_text") or "").replace("\n", " ")
    _fields([
        ("sample", sample.get("sample_id")),
        ("status", sample.get("status")),
        ("source", sample.get("source")),
        ("session", sample.get("session_id")),
        ("task", sample.get("rl_task_id")),
        ("policy", sample.get("policy_version")),
        ("served", sample.get("instance")),  # by which vLLM instance
        ("sampling", _sampling_text(sample.get("sampling"))),
        ("shaped", _constraints_text(sample.get("sampling"))),  # by its constraints
        ("training", _exclusion_text(sample.get("exclusion"))),
        ("choice", f"{sample['choice_index']} of group {sample.get('group_uid')}"
                   if sample.get("choice_index") is not None else None),
        ("created", sample.get("created_at")),
        ("judge", f"score {judge.get('score')} ({judge.get('source')}"
                  + (f", tag {judge['tag']})" if judge.get("tag") else ")") if judge else None),
        ("tokens", f"prompt {len(trajectory.get('prompt_ids') or [])}, "
                   f"response {len(trajectory.get('response_ids') or [])}"),
        ("reply", reply[:200] + ("…" if len(reply) > 200 else "")),
    ])


# ---------------------------------------------------------------------------------------------- handlers


def _service(action: str) -> Callable[[Context], int]:
    method, path = {"start": ("POST", "/v1/rl/service/start"), "stop": ("POST", "/v1/rl/service/stop"),
                    "status": ("GET", "/v1/rl/service")}[action]

    def handler(ctx: Context) -> int:
        ctx.show(ctx.client.request(method, path), _show_service)
        return 0

    return handler


def _task_start(ctx: Context) -> int:
    body: dict[str, Any] = {"reward_mode": ctx.args.mode}
    if ctx.args.capture_secret:
        body["capture_secret"] = True
    if ctx.args.evaluation:
        body["evaluation"] = True
    task = ctx.client.request("POST", "/v1/rl/tasks/start", body=body,
                              headers={"X-Agent-Session-Id": ctx.args.session})
    ctx.show(task, _show_task_started)
    return 0


def _show_task_started(task: dict[str, Any]) -> None:
    _show_task(task)
    if task.get("capture_secret"):
        # Printed once: the gateway keeps only its digest. The agent sends it with every inference call.
        _fields([("capture secret", task["capture_secret"])])
        _out("(shown once; the agent sends it as X-Agent-Capture-Secret on every call of the session)")


def _task_stop(ctx: Context) -> int:
    ctx.show(ctx.client.request("POST", f"/v1/rl/tasks/{_q(ctx.args.id)}/stop"), _show_task)
    return 0


def _task_get(ctx: Context) -> int:
    ctx.show(ctx.client.request("GET", f"/v1/rl/tasks/{_q(ctx.args.id)}"), _show_task)
    return 0


def _task_events(ctx: Context) -> int:
    ctx.show(ctx.client.request("GET", f"/v1/rl/tasks/{_q(ctx.args.id)}/events"), _show_events)
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
        _err(f"more: --cursor {result['next_cursor']} (or --all)")
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
    result = _pages(ctx, "/v1/rl/tasks", _page_params(ctx))
    ctx.show(result, lambda r: _show_task_rows(r["items"]))
    return 0


def _train_list(ctx: Context) -> int:
    result = _pages(ctx, "/v1/rl/training/runs", _page_params(ctx))
    ctx.show(result, lambda r: _show_run_rows(r["items"]))
    return 0


def _train_events(ctx: Context) -> int:
    ctx.show(ctx.client.request("GET", f"/v1/rl/training/runs/{_q(ctx.args.run_id)}/events"), _show_events)
    return 0


def _policy_report(ctx: Context) -> int:
    params = {"lineage": ctx.args.lineage} if ctx.args.lineage else None
    ctx.show(ctx.client.request("GET", "/v1/rl/policies", params=params), _show_policies)
    return 0


def _lineage_list(ctx: Context) -> int:
    result = _pages(ctx, "/v1/rl/lineages", _page_params(ctx))
    ctx.show(result, lambda r: _show_lineage_rows(r["items"]))
    return 0


def _task_reward(ctx: Context) -> int:
    answer = ctx.client.request("POST", f"/v1/rl/tasks/{_q(ctx.args.id)}/reward", body={"reward": ctx.args.value})
    ctx.show(answer, lambda a: _out(f"task {ctx.args.id}: reward {ctx.args.value} recorded, "
                                    f"{a.get('sample_count')} sample(s) published"))
    return 0


def _train_start(ctx: Context) -> int:
    body = {"lineage": ctx.args.lineage} if ctx.args.lineage else None  # absent: the default lineage, as before
    run = ctx.client.request("POST", "/v1/rl/training/runs", body=body)
    if ctx.args.watch:
        # The created run is the first state shown: a fast run may already have steps at the first poll.
        return _watch(ctx, run["training_run_id"], seen=run)
    ctx.show(run, _show_run)
    return 0


def _train_watch(ctx: Context) -> int:
    return _watch(ctx, ctx.args.run_id)


def _train_stop(ctx: Context) -> int:
    ctx.show(ctx.client.request("POST", f"/v1/rl/training/runs/{_q(ctx.args.run_id)}/stop"), _show_run)
    return 0


def _train_get(ctx: Context) -> int:
    ctx.show(ctx.client.request("GET", f"/v1/rl/training/runs/{_q(ctx.args.run_id)}"), _show_run)
    return 0


def _run_line(run: dict[str, Any]) -> str:
    line = (f"{run.get('training_run_id')}: {run.get('status')} "
            f"(stage {run.get('stage')}, {run.get('sample_count')} samples)")
    if run.get("status") == RunStatus.SUCCEEDED or (run.get("lora_name") and run.get("status") in TERMINAL_STATUSES):
        line += f" lora {run.get('lora_name')} at {run.get('lora_path')}"
    if run.get("failure_reason"):
        line += f": {run['failure_reason']}"
    return line


def _step_line(step: Any) -> str:
    if not isinstance(step, Mapping):
        return f"  step: {step}"
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in step.items() if k != "step"]
    return f"  step {step.get('step', '?')}: " + " ".join(parts)


def _watch(ctx: Context, run_id: str, *, seen: dict[str, Any] | None = None) -> int:
    """Poll the run until it is terminal, printing each status/stage change and each new step's metrics.
    0 when it succeeded, 1 when it failed or was canceled (or watching had to give up). `seen`: a record of the run
    already in hand (the start answer), shown first."""
    interval_s, timeout_s = ctx.args.interval, ctx.args.watch_timeout
    deadline = ctx.clock() + timeout_s if timeout_s > 0 else None
    last_state: tuple[Any, Any] | None = None
    last_record: Any = None
    if seen is not None and seen.get("status") not in TERMINAL_STATUSES:
        _raw(orjson.dumps(seen).decode()) if ctx.as_json else _out(_run_line(seen))
        last_state, last_record = (seen.get("status"), seen.get("stage")), seen
    steps_shown = 0
    failures = 0
    while True:
        try:
            run = ctx.client.request("GET", f"/v1/rl/training/runs/{_q(run_id)}")
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
            _err(f"warning: polling {run_id}: {problem}")
            if failures >= WATCH_MAX_ERRORS:
                raise CliError(f"gave up watching {run_id} after {failures} failed polls")
        else:
            failures = 0
            steps = (run.get("metrics") or {}).get("step_metrics") or []
            if ctx.as_json:
                if run != last_record:
                    _raw(orjson.dumps(run).decode())
            else:
                for step in steps[steps_shown:]:
                    _out(_step_line(step))
                state = (run.get("status"), run.get("stage"))
                if state != last_state:
                    _out(_run_line(run))
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
    ctx.show(ctx.client.request("GET", f"/v1/loras/{_q(model)}"), _show_lora(model))
    return 0


def _fmt_reward(reward: dict[str, Any] | None) -> str:
    reward = reward or {}
    if not reward.get("n"):
        return "no reward yet"
    ci = reward.get("ci95")
    interval = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
    return f"{reward['mean']:.3f}{interval} over {reward['n']} Task(s)"


def _show_rollout_record(record: dict[str, Any]) -> None:
    decision = record.get("decision") or record.get("evaluation") or {}
    rows = [
        ("rollout", record.get("rollout_id")),
        ("kind", f"{record.get('kind')} ({record.get('mode')})"),
        ("status", record.get("status")),
        ("candidate", (record.get("candidate") or {}).get("lora_name")),
        ("against", (record.get("baseline") or {}).get("lora_name")),
    ]
    if record.get("kind") == "canary":
        rows.append(("share", record.get("share")))
        for arm in ("candidate", "active"):
            row = (decision.get("arms") or {}).get(arm)
            if row:
                rows.append((f"{arm} arm", f"{row.get('lora_name')}: {row.get('tasks')} Task(s), "
                                            f"{row.get('failed')} failed, reward {_fmt_reward(row.get('reward'))}"))
        ci = decision.get("ci95")
        if decision.get("reward_delta") is not None:
            rows.append(("difference", f"{decision['reward_delta']:+.4f}"
                                       + (f" [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else "")))
    verb = "decided" if record.get("decision") else "would"
    rows.append((verb, f"{decision.get('action')}: {decision.get('reason')} — {decision.get('detail', '')}"
                 if decision else None))
    _fields(rows)


def _show_rollout(status: dict[str, Any]) -> None:
    _out(f"mode: {status.get('mode')}")
    current = status.get("current")
    if current is None:
        _out("no rollout in progress")
    else:
        _show_rollout_record(current)
    for record in (status.get("recent") or [])[:5]:
        _out(f"{record.get('created_at')}  {record.get('rollout_id')}  {record.get('kind'):<10} "
             f"{(record.get('candidate') or {}).get('lora_name')}  {record.get('status')}")


def _rollout_status(ctx: Context) -> int:
    params = {"lineage": ctx.args.lineage} if ctx.args.lineage else None  # absent: the default line, as before
    ctx.show(ctx.client.request("GET", "/v1/rl/rollout", params=params), _show_rollout)
    return 0


def _rollout(action: str) -> Callable[[Context], int]:
    def handler(ctx: Context) -> int:
        body = {"lineage": ctx.args.lineage} if ctx.args.lineage else None  # absent: the default line, as before
        ctx.show(ctx.client.request("POST", f"/v1/rl/rollout/{action}", body=body), _show_rollout_record)
        return 0

    return handler


def _rollout_events(ctx: Context) -> int:
    ctx.show(ctx.client.request("GET", f"/v1/rl/rollout/{_q(ctx.args.rollout_id)}/events"), _show_events)
    return 0


def _lineage(action: str) -> Callable[[Context], int]:
    def handler(ctx: Context) -> int:
        path = f"/v1/rl/lineages/{_q(ctx.args.lineage)}"
        answer = (ctx.client.request("GET", path) if action == "get"
                  else ctx.client.request("POST", f"{path}/{action}"))
        ctx.show(answer, _show_lineage)
        return 0

    return handler


def _lineage_delete(ctx: Context) -> int:
    """Ask for the deletion; with `--wait`, poll until the lineage is gone (404 `lineage_not_found`)."""
    path = f"/v1/rl/lineages/{_q(ctx.args.lineage)}"
    answer = ctx.client.request("POST", f"{path}/delete", body={"remove_files": ctx.args.remove_files})
    ctx.show(answer, _show_lineage)
    if not ctx.args.wait:
        return 0
    deadline = ctx.clock() + ctx.args.watch_timeout if ctx.args.watch_timeout > 0 else None
    while True:
        ctx.sleep(ctx.args.interval)
        try:
            ctx.client.request("GET", path)
        except ErrorAnswer as exc:
            if exc.status != 404:
                raise
            if not ctx.as_json:
                _out(f"lineage {ctx.args.lineage} deleted")
            return 0
        if deadline is not None and ctx.clock() >= deadline:
            raise CliError(f"lineage {ctx.args.lineage} not deleted after {ctx.args.watch_timeout:g} s (the "
                           "deletion goes on)")


def _lora_activate(ctx: Context) -> int:
    record = ctx.client.request("POST", "/v1/rl/loras/activate", body={"lora_name": ctx.args.lora_name})
    ctx.show(record, _show_rollout_record)
    return 0 if record.get("status") == "activated" else 1


def _lora_delete(ctx: Context) -> int:
    ctx.client.request("DELETE", f"/v1/loras/{_q(ctx.args.model)}")
    ctx.show({"model": ctx.args.model, "status": BASE_POLICY},
             lambda _: _out(f"{ctx.args.model}: LoRA deactivated; new Tasks use the base model "
                            "(running Tasks keep their pinned version)"))
    return 0


def _show_instances(data: dict[str, Any]) -> None:
    _table([[str(i.get("name")), str(i.get("model")), str(i.get("address")), str(i.get("origin")),
             "yes" if i.get("serving") else "no", ", ".join(i.get("loaded") or []) or "-"]
            for i in data.get("items", [])],
           ["NAME", "MODEL", "ADDRESS", "ORIGIN", "SERVING", "LOADED"])
    _out(f"registered {data.get('registered')} of at most {data.get('max_registered')}")


def _instance_list(ctx: Context) -> int:
    ctx.show(ctx.client.request("GET", "/aigw/v1/instances"), _show_instances)
    return 0


def _instance_remove(ctx: Context) -> int:
    # The name goes in the signed body: a signature cannot be moved to another instance.
    answer = ctx.client.request("POST", "/aigw/v1/unregister-instance", body={"name": ctx.args.name})
    ctx.show(answer, lambda a: _out(f"instance {a.get('name')} removed: no new requests go there; requests in "
                                    "flight finish"))
    return 0


def _traj_stats(ctx: Context) -> int:
    params = {"lineage": ctx.args.lineage} if ctx.args.lineage else None  # absent: the default line, as before
    ctx.show(ctx.client.request("GET", "/v1/rl/trajectories/stats", params=params), _show_stats)
    return 0


def _traj_list(ctx: Context) -> int:
    result = _pages(ctx, "/v1/rl/trajectories", _page_params(ctx))
    ctx.show(result, lambda r: _show_items(r["items"]))
    return 0


def _traj_reward(ctx: Context) -> int:
    body = {"source": ctx.args.source, "score": ctx.args.score}
    answer = ctx.client.request("POST", f"/v1/rl/trajectories/{_q(ctx.args.id)}/rewards", body=body)
    ctx.show(answer, lambda a: _out(
        f"sample {ctx.args.id}: {ctx.args.source} {ctx.args.score:g} "
        f"{'recorded' if a.get('recorded') else 'already recorded'}; status {a.get('status')}, "
        f"score {(a.get('rewards') or {}).get('score')}"))
    return 0


def _traj_exclude(ctx: Context) -> int:
    answer = ctx.client.request("POST", "/v1/rl/trajectories/exclude", body={"instance": ctx.args.instance})
    ctx.show(answer, lambda a: _out(
        f"instance {a.get('instance')} excluded: {a.get('excluded')} sample(s) moved to `excluded` now, later ones "
        f"are filed there too; {a.get('training')} already in the running Training Run stay with it (cancel the "
        f"run to exclude them as well); excluded instances: {', '.join(a.get('excluded_instances') or [])}"))
    return 0


def _traj_get(ctx: Context) -> int:
    ctx.show(ctx.client.request("GET", f"/v1/rl/trajectories/{_q(ctx.args.id)}"), _show_sample)
    return 0


def _console_url(ctx: Context) -> int:
    ttl_s = ctx.args.ttl
    if not 0 < ttl_s * 1000 <= MAX_LOGIN_TTL_MS:
        raise CliError(f"--ttl must be between 1 and {MAX_LOGIN_TTL_MS // 1000} seconds", exit_code=2)
    expires_ms = time.time_ns() // 1_000_000 + int(ttl_s * 1000)
    url = ctx.client.console_login_url(expires_ms=expires_ms)
    expires_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires_ms / 1000))
    ctx.show({"url": url, "expires_at": expires_at},
             lambda d: (_out(d["url"]), _err(f"single use; open it before {d['expires_at']}")))
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
        _err(f"error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
