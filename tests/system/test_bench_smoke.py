"""Every bench script runs to the end, once, at its smallest size: a refactor that breaks a bench (as a lost import
once broke `make bench-quick` with a NameError in bench/hooks_bench.py) fails `make test`, not the next person who
runs the benches.

The numbers of these runs mean nothing; what is checked is that each bench exits 0 and writes the result file
with the keys bench/run_all.py renders from (and the page renders from them). Everything goes to a temporary
folder (`--out`, `--results`, `--doc`): bench/results/ and docs/benchmarks.md are left alone. No peer is installed
or started (`--no-peers`: the capture peers and the `openjiuwen` SDK service live in bench/.peers/ and come from
PyPI). bench/gpu/ is covered by tests/unit/test_verl_gpu_script.py (its `--help` and `--dry-run` checks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench import run_all

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TIMEOUT_S = 300

# Benches run by `run_all.py --smoke`, and the keys their result files must carry (what render() reads).
RUN_ALL_KEYS = {
    "capture": {"latency_ms", "results", "captures_committed", "captures_expected", "peers", "machine"},
    "hooks": {"pairs", "prompt_tokens", "completion_tokens", "after_body_bytes", "pair_ms", "before_ms_median",
              "after_ms_median", "pairs_per_second", "concurrent", "redis_bytes_per_token", "load_avg"},
    "storage": {"samples", "sessions", "turns", "first_prompt_tokens", "completion_tokens", "captured_tokens",
                "repeated_prompt_tokens", "held_prompt_ids", "captured_prompt_ids", "prompt_blocks",
                "bytes_per_token"},
    "scaling": {"claim_batch", "claim_and_stats", "recovery", "machine"},
    "training": {"samples", "prompt_tokens", "response_tokens", "wall_seconds", "ppo_seconds",
                 "response_tokens_per_second_ppo", "sequence_tokens_per_second_wall"},
    "load": {"sessions", "turns", "duration_s", "requests", "requests_per_s", "errors", "completions", "latency_ms",
             "rss_mib", "invariants", "samples_stored", "workers", "workers_killed"},
    "load-kills": {"sessions", "turns", "duration_s", "requests", "requests_per_s", "errors", "completions",
                   "latency_ms", "rss_mib", "invariants", "samples_stored", "workers", "workers_killed"},
    "chaos": {"totals", "runs"},
}
CAPTURE_ROW_KEYS = {"size", "format", "concurrency", "calls", "prompt_tokens", "completion_tokens", "direct",
                    "bypass", "captured", "added_p50_ms", "added_p99_ms", "throughput_ratio", "load_avg_1m"}
# Scripts with a __main__ that are not benches of their own, and why.
NOT_BENCHES = {
    "bench/upstream.py": "the fake vLLM the capture bench starts (runs inside the capture smoke run)",
    "bench/peers.py": "installs the third-party peers from PyPI: never in tests",
    "bench/peer_agentlightning.py": "launches a third-party peer: never in tests",
    "bench/gpu/verl_run.py": "GPU check: tests/unit/test_verl_gpu_script.py runs its checks",
    "bench/gpu/local_multi.py": "GPU check taking a model directory: tests/unit/test_local_multi_bench.py runs its CPU "
                                "size with verl, Ray and the project hidden",
    "bench/constrained_learning_bench.py": "needs a real vLLM and SmolLM2: tests/system/test_constrained_real_vllm.py "
                                           "runs its run() once, tiny, on that module's vLLM",
}
# Benches outside run_all.py, each with its smallest arguments (documented in its --help).
SEPARATE: dict[str, list[str]] = {
    # issue 28 item 4: a 300 MiB answer against the 64 MiB bound takes ~15 s; the smoke run sends 8 MiB past 1 MiB.
    "bench/upstream_size_bench.py": ["--answer-mib", "8", "--limit-mib", "1"],
    # issue 27 item 6: adapter paging under many lineages, at a tenth of its quick size.
    "bench/lineage_paging_bench.py": ["--lines", "100", "--hot", "16", "--slots", "4", "--requests", "200"],
    # issue 27 item 6: the RL Service under many lineages; 8 lines with samples at 10 and 40 registered lineages.
    "bench/lineage_scale_bench.py": ["--sizes", "10", "40", "--pending-lines", "8", "--samples", "8", "--batches",
                                     "8", "--reps", "2"],
    # issue 37: a claim behind stale samples, quiet and under a flooder; 0 and 100 stale samples, one claim each.
    "bench/stale_claim_bench.py": ["--stale", "0", "100", "--reps", "1"],
    # issue 36 item 6: per-run vs warm trainer, 2 lineages of 4 short samples on the tiny model (its --quick).
    "bench/lineage_training_bench.py": ["--quick"],
    # issue 35: greedy samples trained with `correct` vs sampled ones vs excluded, one seed on a few prompts.
    "bench/greedy_bench.py": ["--seeds", "0", "--prompts", "4", "--held-out", "2", "--length", "4"],
    # issue 38 item 4: the SmolLM2-recipe Training Run, A/B; the tiny model, 4 samples, this tree as the baseline.
    "bench/recipe_training_bench.py": ["--model-dir", "tiny", "--samples", "4", "--max-tokens", "4", "--repeats", "1",
                                       "--baseline-src", "."],
}


def run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    (tmp_path / f"{Path(argv[0]).stem}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc


def load(path: Path) -> dict:
    assert path.exists(), f"{path.name} was not written"
    return orjson.loads(path.read_bytes())


def test_every_bench_script_is_smoke_run() -> None:
    """A new bench cannot slip past this file: every script under bench/ with a __main__ is run here (through
    run_all.py or on its own) or is listed as not being a bench."""
    scripts = {str(p.relative_to(ROOT)) for p in BENCH.rglob("*.py")
               if ".peers" not in p.parts and "__main__" in p.read_text(encoding="utf-8")}
    smoke_run = {args[0] for *_, args in run_all.BENCHES.values()} | set(SEPARATE) | {"bench/run_all.py"}
    assert scripts - smoke_run - set(NOT_BENCHES) == set()
    assert set(RUN_ALL_KEYS) == set(run_all.BENCHES) - set(run_all.PEER_BENCHES)


def test_run_all_smoke_runs_every_bench_and_renders_the_page(tmp_path: Path) -> None:
    results, doc = tmp_path / "results", tmp_path / "benchmarks.md"
    peers_dir = BENCH / ".peers"
    peers_before = sorted(peers_dir.iterdir()) if peers_dir.exists() else None
    run(["bench/run_all.py", "--smoke", "--no-peers", "--results", str(results), "--doc", str(doc)], tmp_path)

    written = {p.stem for p in results.glob("*.json")}
    assert written == set(RUN_ALL_KEYS), "the peer benches (hooks-sdk, storage-sdk) must not run with --no-peers"
    for name, keys in RUN_ALL_KEYS.items():
        result = load(results / f"{name}.json")
        assert keys <= set(result), f"{name}.json lacks {keys - set(result)}"
    capture = load(results / "capture.json")
    assert capture["peers"] == {} and capture["results"]
    for row in capture["results"]:
        assert CAPTURE_ROW_KEYS <= set(row) and not any(k.startswith("peer:") for k in row)
    assert capture["captures_committed"] == capture["captures_expected"] > 0
    assert load(results / "scaling.json")["claim_and_stats"]

    page = doc.read_text(encoding="utf-8")
    assert "Mode: smoke." in page
    for section in ("## Capture overhead", "## RL Service hook path", "## Storage", "## Scaling",
                    "## Training throughput", "## Load at scale", "## Chaos sweep", "## Peers"):
        assert section in page
    assert (sorted(peers_dir.iterdir()) if peers_dir.exists() else None) == peers_before  # nothing installed
    # The load runs, one of them killing a worker of the RL Service under the load, and the chaos run.
    for name in ("load", "load-kills"):
        result = load(results / f"{name}.json")
        assert result["errors"] == 0 and result["invariants"]["ok"] and result["completions"] > 0, result
        assert result["samples_stored"] == result["completions"] == result["invariants"]["samples"]
        assert result["invariants"]["tasks"] > 0  # the checker's own count, printed by the bench
    kills = load(results / "load-kills.json")
    assert (kills["workers"], kills["workers_killed"], kills["workers_restarted"]) == (2, 1, 1)
    chaos = load(results / "chaos.json")["totals"]
    assert chaos["runs"] == 1 and chaos["failed_runs"] == 0 and chaos["worker_kills"] >= 1


@pytest.mark.parametrize("script", sorted({args[0] for *_, args in run_all.BENCHES.values()} | set(SEPARATE)))
def test_help_documents_every_size_flag(script: str, tmp_path: Path) -> None:
    """Each bench's --help names every flag run_all.py passes it (full, quick and smoke sizes), so `make bench` and
    `make bench-quick` cannot pass a flag the bench lost."""
    used = [*SEPARATE.get(script, []), *(a for variants in run_all.BENCHES.values() for args in variants
                                          if args[0] == script for a in args[1:])]
    text = run([script, "--help"], tmp_path).stdout
    for flag in {a for a in used if a.startswith("--")} | {"--out"}:
        assert flag in text, f"{script} --help does not mention {flag}"


@pytest.mark.parametrize("script", sorted(SEPARATE))
def test_each_separate_bench_runs_at_its_smallest_size(script: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run([script, *SEPARATE[script], "--out", str(out)], tmp_path)
    assert load(out)


def test_lineage_scale_bench_shows_costs_independent_of_registered_lineages(tmp_path: Path) -> None:
    """What docs/lineages.md "Capacity planning" states from this bench, on its smallest run: a tick issues the same
    Redis commands at 10 and 40 registered lineages (the same 8 with samples), and a lineage's claim the same as the
    default line's plus its lifecycle state. Command counts, not times: they do not depend on the machine's load."""
    out = tmp_path / "lineage_scale.json"
    run(["bench/lineage_scale_bench.py", *SEPARATE["bench/lineage_scale_bench.py"], "--out", str(out)], tmp_path)
    result = load(out)
    small, large = result["ticks"]
    assert (small["registered"], large["registered"]) == (10, 40)
    assert small["lines_with_samples"] == large["lines_with_samples"] == 8
    for case in ("eligible", "none_eligible"):
        assert small[case]["commands"] == large[case]["commands"], case
        assert small[case]["commands"]["max"] > 0
    assert small["eligible"]["chosen"] and not small["none_eligible"]["chosen"]
    default, lineage = result["claims"]
    assert (default["lineage"], lineage["lineage"], default["batch"]) == ("default", "user-000000", 8)
    # The same but for the lineage's lifecycle state, WATCHed and read once (lineage_state.require_live): O(1).
    assert lineage["commands"]["max"] - default["commands"]["max"] == 2
    assert lineage["commands"]["min"] - default["commands"]["min"] == 2
    memory = result["memory"]
    assert memory["registered"] == 40 and memory["lines_with_samples"] == 8
    assert memory["line_keys_bytes"]["total"] > 0 and memory["used_memory_per_line_with_samples"] > 0
