"""docs/benchmarks.md is generated from the bench result files: every figure on it must come from them (or from the
machine facts and run times handed to the renderer). A figure typed into the generator ("~65 %", "~2.2 ms") would
be printed unchanged by every later run, right or not; such prose lives in the hand-written benchmarks-notes.md.

The check: render the page from two result sets that share their structure but no measured value; a number that
sits at the same place in both pages, unchanged, did not come from the results. Targets ("≤ 10 ms", or on a line
that names a target) and code in backticks (`rl:v1:…`, `==0.1.19.post2`) are the only numbers the generator may write.
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from bench import run_all

# Concurrency 64 is where the capture targets are stated: both sets keep it, so it may repeat.
SHARED_VALUES = {"64"}
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?!\w)")
CODE = re.compile(r"`[^`]*`")
TARGET = re.compile(r"[≤≥]\s*\d[\d,.]*")  # "(≤ 2)": a target, where a measured value stands beside it


def _timings(k: float) -> dict:
    return {"p50_ms": 11.3 * k, "p99_ms": 23.9 * k, "throughput_rps": 157.0 * k,
            "cpu_ms_per_call": {"gateway": 1.17 * k, "rl_service": 2.31 * k, "redis": 0.43 * k}}


def result_set(k: float) -> dict[str, dict]:
    """Every result file render() reads, each measured value scaled by k (k > 1 apart between sets)."""
    rows = []
    for size, (prompt, completion) in {"small": (round(300 * k), round(200 * k)),
                                       "large": (round(1900 * k), round(1700 * k))}.items():
        rows.append({"size": size, "format": "json", "concurrency": 64, "calls": round(90 * k),
                     "prompt_tokens": prompt, "completion_tokens": completion, "load_avg_1m": 0.77 * k,
                     "direct": _timings(k), "bypass": _timings(1.3 * k), "captured": _timings(1.7 * k),
                     "peer:rllm": _timings(2.9 * k), "added_p50_ms": 5.3 * k, "added_p99_ms": 8.1 * k,
                     "throughput_ratio": 0.61 * k})
    hooks = {"prompt_tokens": round(1500 * k), "completion_tokens": round(1300 * k),
             "after_body_bytes": 333_000 * k, "pairs": round(70 * k), "pairs_per_second": 123.4 * k,
             "pair_ms": {"median": 4.44 * k, "p99": 9.13 * k, "mean": 5.01 * k},
             "before_ms_median": 1.23 * k, "after_ms_median": 3.21 * k, "load_avg": [0.91 * k] * 3,
             "concurrent": {"callers": round(7 * k), "pairs_per_second": 211.0 * k, "median_ms": 17.7 * k,
                            "p99_ms": 41.3 * k},
             "redis_bytes_per_token": {"staged": 7.77 * k, "published": 8.88 * k},
             "service_label": "ours"}
    storage = {"samples": round(15 * k), "sessions": round(3 * k), "turns": round(5 * k),
               "first_prompt_tokens": round(900 * k), "completion_tokens": round(400 * k),
               "captured_tokens": round(33_000 * k), "repeated_prompt_tokens": round(21_000 * k),
               "held_prompt_ids": round(9_000 * k), "captured_prompt_ids": round(27_000 * k),
               "prompt_blocks": round(37 * k), "bytes_per_token": {"ours": 5.21 * k, "naive_json": 43.1 * k}}
    return {
        "capture": {"latency_ms": 190.0 * k, "results": rows, "captures_committed": round(700 * k),
                    "captures_expected": round(800 * k), "peers": {"rllm": "measured"}},
        "hooks": hooks,
        # k² here: the page prints ours against the SDK's as ratios, which a common factor would leave unchanged.
        "hooks-sdk": {**hooks, "pair_ms": {"median": 47.0 * k * k, "p99": 240.0 * k * k, "mean": 60.0 * k * k},
                      "concurrent": {**hooks["concurrent"], "pairs_per_second": 9.0 * k * k}},
        "storage": storage,
        "storage-sdk": {**storage, "bytes_per_token": {"ours": 88.1 * k, "naive_json": 43.1 * k}},
        "scaling": {"claim_batch": round(110 * k), "recovery": {
            "active_tasks": round(9000 * k), "recovery_s": 7.1 * k, "tasks_per_s": 1100.0 * k,
            "ready_s_with_tasks": 7.9 * k, "ready_s_empty": 0.66 * k},
            "claim_and_stats": [{"pending": round(9000 * k), "claim128_ms": {"median": 12.2 * k, "p99": 15.1 * k},
                                 "stats_ms": {"median": 0.31 * k, "p99": 0.42 * k},
                                 "redis_used_memory_mb": 14.0 * k, "load_avg_1m": 1.6 * k}]},
        "training": {"samples": round(7 * k), "prompt_tokens": round(230 * k), "response_tokens": round(220 * k),
                     "wall_seconds": 3.9 * k, "ppo_seconds": 0.9 * k, "response_tokens_per_second_ppo": 13000 * k,
                     "sequence_tokens_per_second_wall": 900 * k},
        "load": _load_result(k, workers=round(2 * k), killed=0),
        "load-kills": _load_result(1.1 * k, workers=round(3 * k), killed=round(5 * k)),
        "chaos": {"totals": {"runs": round(40 * k), "scenarios": round(29 * k), "wall_s": 310.0 * k,
                             "kills": round(210 * k), "worker_kills": round(90 * k), "redis_faults": round(12 * k),
                             "failed_runs": round(1 * k)},
                  "runs": [{"scenario": s, "ok": True, "kills": round(n * k), "redis_faults": round(2 * n * k),
                            "tasks_started": round(8 * n * k), "tasks_abandoned": round(n * k),
                            "samples": round(17 * n * k), "samples_checked": round(16 * n * k),
                            "max_error_latency_s": 0.07 * n * k}
                           for s, n in (("crash:capture.committed", 1.1), ("wcrash:run.claimed", 1.3),
                                        ("kill:worker", 1.7)) for _ in range(round(2 * k))]},
    }


def _load_result(k: float, *, workers: int, killed: int) -> dict:
    return {"sessions": round(250 * k), "turns": round(4 * k), "duration_s": 61.0 * k, "requests": round(9000 * k),
            "requests_per_s": 140.0 * k, "errors": round(3 * k), "completions": round(5000 * k),
            "samples_stored": round(5001 * k), "workers": workers, "workers_killed": killed,
            "latency_ms": {"chat_json": {"p50": 410.0 * k, "p99": 1300.0 * k},
                           "chat_sse": {"p50": 420.0 * k, "p99": 1400.0 * k}},
            "rss_mib": {"gateway": {"before": 70.0 * k, "after": 73.0 * k},
                        "rl_service": {"before": 210.0 * k, "after": 217.0 * k}},
            "invariants": {"ok": True}}


def render(tmp_path: Path, k: float) -> list[str]:
    folder = tmp_path / f"set-{k}"
    folder.mkdir()
    for name, result in result_set(k).items():
        (folder / f"{name}.json").write_bytes(orjson.dumps(result))
    machine = {"cpus": round(3 * k), "cpu_model": "test CPU", "python": f"3.{round(9 * k)}.{round(4 * k)}",
               "load_avg": [0.51 * k, 0.52 * k, 0.53 * k]}
    seconds = {name: 13.0 * k for name in run_all.BENCHES}
    return run_all.render("quick", seconds, folder, machine=machine).splitlines()


def fixed_numbers(a: list[str], b: list[str]) -> list[str]:
    assert len(a) == len(b), "the two renders should have the same lines (same structure)"
    found = []
    for line_a, line_b in zip(a, b):
        if "arget" in line_a:  # a line stating targets may write them
            continue
        nums_a = NUMBER.findall(TARGET.sub("≤", CODE.sub("``", line_a)))
        nums_b = NUMBER.findall(TARGET.sub("≤", CODE.sub("``", line_b)))
        found += [f"{x!r} in: {line_a}" for x, y in zip(nums_a, nums_b) if x == y and x not in SHARED_VALUES]
    return found


def test_every_number_on_the_generated_page_comes_from_the_results(tmp_path: Path) -> None:
    a, b = render(tmp_path, 1.0), render(tmp_path, 1.9)
    assert a != b
    assert fixed_numbers(a, b) == []
    page = "\n".join(a)
    for section in ("## Capture overhead", "## RL Service hook path", "## Storage", "## Scaling",
                    "## Training throughput", "## Load at scale", "## Chaos sweep", "## Peers"):
        assert section in page
    assert "benchmarks-notes.md" in page  # the hand-written notes are linked


def test_the_check_finds_a_typed_in_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a generator that writes a fixed figure (as it once wrote "~65 %") is caught."""
    real = run_all.render

    def with_figure(*args, **kwargs) -> str:
        return real(*args, **kwargs) + "\nthe collector took ~65 % of the CPU"

    monkeypatch.setattr(run_all, "render", with_figure)
    a, b = render(tmp_path, 1.0), render(tmp_path, 1.9)
    assert any("'65'" in f for f in fixed_numbers(a, b))


def test_the_notes_page_holds_the_figures_that_left_the_generator() -> None:
    notes = (Path(run_all.ROOT) / "docs" / "benchmarks-notes.md").read_text(encoding="utf-8")
    assert "## CPU per captured call" in notes and "## Storage" in notes and "## Peers" in notes
    source = (Path(run_all.ROOT) / "bench" / "run_all.py").read_text(encoding="utf-8")
    for figure in ("~65 %", "~2.2 ms", "7.88", "29056", "~230 ms"):
        assert figure not in source


def test_a_peer_that_failed_in_a_row_is_reported_and_its_cell_left_empty(tmp_path: Path) -> None:
    results = result_set(1.0)
    small, large = results["capture"]["results"]
    small["peer:agentlightning"] = _timings(3.3)
    large["peer_errors"] = {"agentlightning": "ConnectionResetError: [Errno 104] Connection reset by peer"}
    for name, result in results.items():
        (tmp_path / f"{name}.json").write_bytes(orjson.dumps(result))
    machine = {"cpus": 2, "cpu_model": "test CPU", "python": "3.11.7", "load_avg": [0.5, 0.5, 0.5]}
    page = run_all.render("quick", {name: 1.0 for name in run_all.BENCHES}, tmp_path, machine=machine).splitlines()
    assert ("Peer `agentlightning` failed in the large json row at 64 sessions (its cell is —): "
            "ConnectionResetError: [Errno 104] Connection reset by peer") in page
    peer_rows = [line for line in page if line.startswith("| large | json | 64 |") and line.count("|") == 7]
    assert len(peer_rows) == 1 and peer_rows[0].split("|")[5].strip() == "—", peer_rows
