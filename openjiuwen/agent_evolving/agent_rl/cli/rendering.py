"""The operator CLI's human-readable output: one formatter per answer shape, every control character of the answers'
text escaped (captured text and ids come from agents and models and must not drive the operator's terminal)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from ..common.control_chars import escape_controls
from ..online.training.run_records import TERMINAL_STATUSES, RunStatus


def out(text: str = "") -> None:
    """One line of human-readable output, its control characters escaped (issue 28 item 6)."""
    print(escape_controls(text), flush=True)  # flushed per line: `train watch` is read live through pipes


def raw(text: str) -> None:
    """`--json` output: the answer exactly as orjson writes it."""
    print(text, flush=True)


def err(text: str) -> None:
    """A human-readable line on stderr (errors quote the gateway's messages), escaped like `out`."""
    print(escape_controls(text), file=sys.stderr, flush=True)


def fields(rows: Sequence[tuple[str, Any]]) -> None:
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        out(f"{label:<{width}}  {'-' if value is None or value == '' else value}")


def show_service(data: dict[str, Any]) -> None:
    reason = data.get("failure_reason")
    out(f"RL Service: {data.get('status')}" + (f" ({reason})" if reason else ""))


def show_task(task: dict[str, Any]) -> None:
    status = task.get("status")
    if task.get("finish_reason"):
        status = f"{status} ({task['finish_reason']})"
    fields([
        ("task", task.get("rl_task_id")),
        ("session", task.get("agent_session_id")),
        ("status", status),
        ("reward mode", task.get("reward_mode")),
        ("evaluation", "yes (never trained on)" if task.get("evaluation") else "no"),
        ("policy", f"{task.get('policy_lora_name')} (model {task.get('policy_model')})"),
        ("created", task.get("created_at")),
        ("finished", task.get("finished_at")),
    ])


def show_events(data: dict[str, Any]) -> None:
    for event in data.get("items", []):
        out(f"{event.get('at')}  {event.get('type'):<22} {orjson.dumps(event.get('data')).decode()}")


def _trigger_text(trigger: Any) -> str | None:
    """`manual`, or `auto (max_wait_seconds: 5 eligible of 5 pending, oldest waited 61.2 s)`."""
    if not isinstance(trigger, dict):
        return None
    if trigger.get("kind") != "auto":
        return str(trigger.get("kind") or "manual")
    return (f"auto ({trigger.get('reason')}: {trigger.get('eligible_samples')} eligible of "
            f"{trigger.get('pending_samples')} pending, oldest waited {trigger.get('oldest_wait_seconds')} s)")


def show_lineage(data: dict[str, Any]) -> None:
    view = data.get("scheduler") or {}
    policy = data.get("training_policy") or {}
    state = "eligible now" if view.get("eligible") else "not eligible"
    fields([
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


def show_run(run: dict[str, Any]) -> None:
    metrics = run.get("metrics") or {}
    versions = ", ".join(f"{k}={v}" for k, v in (run.get("policy_versions") or {}).items())
    fields([
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


def show_lora(model: str) -> Callable[[dict[str, Any]], None]:
    def show(data: dict[str, Any]) -> None:
        active = data.get("active_lora") or {}
        instances = data.get("instances") or {}
        line = f"{model}: {data.get('status')}"
        if active:
            line += f" {active.get('lora_name')} ({active.get('lora_path')})"
        out(f"{line}; instances ready {instances.get('ready', 0)}, failed {instances.get('failed', 0)}")

    return show


def show_stats(stats: dict[str, Any]) -> None:
    by_status = ", ".join(f"{k} {v}" for k, v in (stats.get("by_status") or {}).items())
    by_source = ", ".join(f"{k} {v}" for k, v in (stats.get("by_source") or {}).items())
    fields([
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


def show_items(items: list[dict[str, Any]]) -> None:
    _table([[_sampling_text(item.get(key)) if key == "sampling" else str(item.get(key) or "-")
             for _, key in _LIST_COLUMNS] for item in items],
           [title for title, _ in _LIST_COLUMNS])


def _table(rows: list[list[str]], titles: list[str]) -> None:
    widths = [max([len(title)] + [len(row[i]) for row in rows]) for i, title in enumerate(titles)]
    for row in [titles, *rows]:
        out("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def show_task_rows(items: list[dict[str, Any]]) -> None:
    _table([[str(t.get("rl_task_id")), str(t.get("status")), str(t.get("finish_reason") or "-"),
             str(t.get("reward_mode")), str(t.get("policy_lora_name")), str(t.get("agent_session_id")),
             str(t.get("created_at"))] for t in items],
           ["TASK", "STATUS", "REASON", "MODE", "POLICY", "SESSION", "CREATED_AT"])


def show_lineage_rows(items: list[dict[str, Any]]) -> None:
    _table([[str(x.get("lineage")), str(x.get("line")), str(x.get("state") or "live"), str(x.get("pending_samples")),
             str(x.get("active_run") or "-"), str(x.get("first_used_at"))] for x in items],
           ["LINEAGE", "LINE", "STATE", "PENDING", "ACTIVE_RUN", "FIRST_USED_AT"])


def show_run_rows(items: list[dict[str, Any]]) -> None:
    _table([[str(r.get("training_run_id")), str(r.get("status")), str(r.get("stage")), str(r.get("sample_count")),
             str(r.get("lora_name") or "-"), str(r.get("created_at"))] for r in items],
           ["RUN", "STATUS", "STAGE", "SAMPLES", "LORA", "CREATED_AT"])


def _num(value: Any, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def show_policies(report: dict[str, Any]) -> None:
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
        out("evaluation Tasks only (never trained on):")
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
        out(f"{comparison['latest']} vs {comparison['parent']}: reward {comparison['reward_delta']:+.3f}"
             + (f" (95% CI {ci[0]:+.3f} .. {ci[1]:+.3f})" if ci else ""))


def show_sample(sample: dict[str, Any]) -> None:
    trajectory = sample.get("trajectory") or {}
    judge = sample.get("judge") or {}
    reply = str(trajectory.get("response_text") or "").replace("\n", " ")
    fields([
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


def show_task_started(task: dict[str, Any]) -> None:
    show_task(task)
    if task.get("capture_secret"):
        # Printed once: the gateway keeps only its digest. The agent sends it with every inference call.
        fields([("capture secret", task["capture_secret"])])
        out("(shown once; the agent sends it as X-Agent-Capture-Secret on every call of the session)")


def run_line(run: dict[str, Any]) -> str:
    line = (f"{run.get('training_run_id')}: {run.get('status')} "
            f"(stage {run.get('stage')}, {run.get('sample_count')} samples)")
    if run.get("status") == RunStatus.SUCCEEDED or (run.get("lora_name") and run.get("status") in TERMINAL_STATUSES):
        line += f" lora {run.get('lora_name')} at {run.get('lora_path')}"
    if run.get("failure_reason"):
        line += f": {run['failure_reason']}"
    return line


def step_line(step: Any) -> str:
    if not isinstance(step, Mapping):
        return f"  step: {step}"
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in step.items() if k != "step"]
    return f"  step {step.get('step', '?')}: " + " ".join(parts)


def _fmt_reward(reward: dict[str, Any] | None) -> str:
    reward = reward or {}
    if not reward.get("n"):
        return "no reward yet"
    ci = reward.get("ci95")
    interval = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
    return f"{reward['mean']:.3f}{interval} over {reward['n']} Task(s)"


def show_rollout_record(record: dict[str, Any]) -> None:
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
    fields(rows)


def show_rollout(status: dict[str, Any]) -> None:
    out(f"mode: {status.get('mode')}")
    current = status.get("current")
    if current is None:
        out("no rollout in progress")
    else:
        show_rollout_record(current)
    for record in (status.get("recent") or [])[:5]:
        out(f"{record.get('created_at')}  {record.get('rollout_id')}  {record.get('kind'):<10} "
             f"{(record.get('candidate') or {}).get('lora_name')}  {record.get('status')}")


def show_instances(data: dict[str, Any]) -> None:
    _table([[str(i.get("name")), str(i.get("model")), str(i.get("address")), str(i.get("origin")),
             "yes" if i.get("serving") else "no", ", ".join(i.get("loaded") or []) or "-"]
            for i in data.get("items", [])],
           ["NAME", "MODEL", "ADDRESS", "ORIGIN", "SERVING", "LOADED"])
    out(f"registered {data.get('registered')} of at most {data.get('max_registered')}")
