"""The demo driver, shortened (a round or two, small batches), end to end WITHOUT a real vLLM: the driver starts its
private Redis and the reference gateway with its RL Service child (scripted trainer) as real processes, its agents
use the official `openai` SDK through the gateway against a fake vLLM on a loopback socket (`--instances`), and the
test checks the report, the plot, the pinning of each round to the version before it, and that nothing the demo
started is left running — after a normal end, after Ctrl-C (SIGINT) during a Training Run, and after a failing step.

`make demo`'s own path (the driver's arguments read from a dry run of the Makefile: SmolLM2's calculator family,
two Training Runs) is `test_make_demo_shows_held_out_success_per_version_the_gain_and_answers_side_by_side`; the
tiny model's family (`make demo-tiny`) is the rest. The full demos on a real vLLM (CPU build) are run by hand:
`make demo`, `make demo-tiny`, `make demo-real` (docs/demo.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from openjiuwen.agent_evolving.agent_rl.demo import calculator_family as calc
from openjiuwen.agent_evolving.agent_rl.demo import sentiment_family as sent
from tests.support.fake_vllm import CHAT_PATH, FakeVLLM, Reply

pytestmark = pytest.mark.system

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_MODULE = "openjiuwen.agent_evolving.agent_rl.demo"
DEMO_TIMEOUT_S = 120
TASKS, TURNS = 4, 2


@pytest.fixture
def vllm() -> Iterator[FakeVLLM]:
    with FakeVLLM(served_model="tiny", name="vllm-fake") as v:
        yield v


def demo_argv(vllm: FakeVLLM, run_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    """The tiny model's family (`make demo-tiny`), one round; `extra` may switch the family."""
    return [sys.executable, "-m", DEMO_MODULE, "--family", "words", "--instances", vllm.url,
            "--trainer", "scripted", "--rounds", "1", "--tasks", str(TASKS), "--turns", str(TURNS),
            "--concurrency", "2", "--run-dir", str(run_dir), "--out-dir", str(out_dir), *extra]


def make_demo_args() -> list[str]:
    """The driver's arguments exactly as `make demo` passes them, from a dry run of the Makefile (`make -n` builds
    nothing and runs nothing)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(["make", "--no-print-directory", "-n", "demo"], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    [line] = [line for line in dry.splitlines() if f" -m {DEMO_MODULE} " in f"{line} "]
    words = shlex.split(line)
    return words[words.index(DEMO_MODULE) + 1:]


def demo_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RL_SERVICE_TOKEN", "RL_SERVICE_CONFIG",
                                                            "ONLINE_RL_SCRIPTED_PLAN")}
    env.update(extra)
    return env


def running_in(run_dir: Path) -> list[str]:
    """Command lines of live processes (not zombies) that name a path inside `run_dir` or run in it."""
    return [cmdline for _, cmdline in _live_in(run_dir)]


def kill_left_in(run_dir: Path) -> None:
    """A demo the test had to SIGKILL could not stop its gateway, RL Service and Redis: they must not outlive the
    test (they would hold ports and CPU for the rest of the suite)."""
    for pid, _ in _live_in(run_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _live_in(run_dir: Path) -> list[tuple[int, str]]:
    needle = f"{run_dir}{os.sep}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cwd = os.readlink(entry / "cwd").encode() + os.sep.encode()  # the demo's Redis runs in run/redis
        except OSError:
            continue
        if (needle in cmdline or cwd.startswith(needle)) and state not in ("Z", "X"):
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def assert_all_gone(run_dir: Path, report: dict) -> None:
    for name, pid in report["processes"].items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        assert state in ("Z", "X"), f"{name} (pid {pid}) still runs"
    assert running_in(run_dir) == []


def test_short_demo_reports_each_version_and_leaves_nothing_running(tmp_path, vllm):
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"

    done = subprocess.run(demo_argv(vllm, run_dir, out_dir), cwd=REPO_ROOT, env=demo_env(), capture_output=True,
                          text=True, timeout=DEMO_TIMEOUT_S)

    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    report = json.loads((out_dir / "demo-report.json").read_text())
    assert report == json.loads((run_dir / "demo-report.json").read_text())
    assert report["status"] == "completed"
    assert [v["policy"] for v in report["versions"]] == ["base", "v1"]
    for version in report["versions"]:
        assert version["tasks"] == TASKS and version["samples"] == TASKS * TURNS
        lo, hi = version["ci95"]
        assert lo <= version["mean_reward"] <= hi
        assert len(version["task_rewards"]) == TASKS
        assert all(0.0 <= r <= 1.0 for r in version["task_rewards"])
    base, v1 = report["versions"]
    assert (base["lora_name"], v1["lora_name"]) == (None, "tiny:v1")
    assert base["training_seconds"] is None and v1["training_seconds"] > 0
    assert set(report["margin"]) == {"last_policy", "last_minus_base", "ci95"}
    assert report["settings"]["rounds"] == 1 and report["settings"]["trainer"] == "scripted"
    assert set(report["timings"]) >= {"setup", "rounds", "training_runs", "total_seconds"}
    [run] = report["timings"]["training_runs"]
    assert (run["lora_name"], run["sample_count"]) == ("tiny:v1", TASKS * TURNS)
    # Round 1 ran on the base model, round 2 on the activated adapter; every completion was captured.
    chats = [r.body for r in vllm.requests if r.path == CHAT_PATH]
    assert [c["model"] for c in chats] == ["tiny"] * (TASKS * TURNS) + ["tiny:v1"] * (TASKS * TURNS)
    assert all(c["return_token_ids"] is True and c["temperature"] == 1.0 for c in chats)
    assert "tiny:v1" in vllm.loaded
    assert (out_dir / "demo-reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mean reward" in done.stdout and "95% CI" in done.stdout
    assert {"redis", "gateway", "rl-service"} <= set(report["processes"])
    assert_all_gone(run_dir, report)


# Both families: `make demo-tiny`'s and `make demo`'s (calculator: evaluation and training Tasks before the run).
@pytest.mark.parametrize("family", [(), ("--family", "calculator", "--eval-tasks", "2", "--model-id", "tiny")],
                         ids=["words", "calculator"])
def test_sigint_during_a_training_run_stops_everything_and_names_the_step(tmp_path, vllm, family):
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"outcome": "block"}))  # the Training Run waits until canceled
    # A suite started in the background by a shell without job control (`make test &`) ignores SIGINT, and an
    # ignored SIGINT is inherited across exec: the demo must get Ctrl-C as a terminal would deliver it.
    proc = subprocess.Popen(demo_argv(vllm, run_dir, out_dir, *family), cwd=REPO_ROOT,
                            env=demo_env(ONLINE_RL_SCRIPTED_PLAN=str(plan)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = []
        deadline = time.monotonic() + DEMO_TIMEOUT_S
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("training run 1/1"):
                break
            assert time.monotonic() < deadline, "".join(seen)
        else:
            pytest.fail("the demo ended before its Training Run:\n" + "".join(seen) + proc.stderr.read())
        time.sleep(1.0)  # the run is in flight

        proc.send_signal(signal.SIGINT)

        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            kill_left_in(run_dir)
    assert proc.returncode == 130, "".join(seen) + out + err
    assert "interrupted (SIGINT) during step 'training run 1/1'" in err, err
    assert f"its log: {run_dir / 'gateway' / 'rl-service.log'}" in err, err
    report = json.loads((run_dir / "demo-report.json").read_text())
    assert (report["status"], report["failed_step"]) == ("interrupted", "training run 1/1")
    assert [v["policy"] for v in report["versions"]] == ["base"]
    assert not (out_dir / "demo-report.json").exists()
    assert_all_gone(run_dir, report)


def test_a_failing_step_is_named_with_its_log_and_nothing_is_left_running(tmp_path, vllm):
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    vllm.fail_next(CHAT_PATH, 500, times=1000)

    done = subprocess.run(demo_argv(vllm, run_dir, out_dir), cwd=REPO_ROOT, env=demo_env(), capture_output=True,
                          text=True, timeout=DEMO_TIMEOUT_S)

    assert done.returncode == 1, done.stdout + done.stderr
    assert "error: step 'round 1/2 (policy base)' failed:" in done.stderr, done.stderr
    assert f"its log: {run_dir / 'gateway' / 'gateway.log'}" in done.stderr
    report = json.loads((run_dir / "demo-report.json").read_text())
    assert (report["status"], report["failed_step"]) == ("failed", "round 1/2 (policy base)")
    assert_all_gone(run_dir, report)


def test_calculator_family_evaluates_each_version_on_the_same_held_out_problems(tmp_path, vllm):
    """The real-model demo's flow, shortened, on the fake vLLM: held-out evaluation Tasks (never trained on) of base,
    a training round, a Training Run that claims only the training Tasks' samples, then the same held-out problems
    on v1; every Task is a tool-using agent (call → tool result fed back → final answer)."""
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    argv = demo_argv(vllm, run_dir, out_dir, "--family", "calculator", "--eval-tasks", "3", "--model-id", "tiny")
    vllm.reply = Reply(content="CALL calc(6*7)")

    done = subprocess.run(argv, cwd=REPO_ROOT, env=demo_env(), capture_output=True, text=True,
                          timeout=DEMO_TIMEOUT_S)

    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    report = json.loads((out_dir / "demo-report.json").read_text())
    assert report["settings"]["family"] == "calculator" and report["settings"]["eval_tasks"] == 3
    base, v1 = report["versions"]
    assert (base["policy"], v1["policy"]) == ("base", "v1")
    for version in (base, v1):
        assert version["tasks"] == 3 and version["samples"] == 6
        assert len(version["task_success"]) == 3 and 0.0 <= version["success_rate"] <= 1.0
        # The fake answers "CALL calc(6*7)" twice: a valid call, never a final answer, so no success.
        assert version["success_rate"] == 0.0 and version["reasons"] == {"no ANSWER:": 3}
        assert all(a["tool_result"] == "RESULT: 42" for a in version["answers"])
    assert [a["question"] for a in base["answers"]] == [a["question"] for a in v1["answers"]]
    [run] = report["timings"]["training_runs"]
    assert run["sample_count"] == TASKS * 2  # the training round's samples only, never the evaluation Tasks'
    assert set(report["success_margin"]) == {"last_policy", "last_minus_base", "ci95"}
    chats = [r.body for r in vllm.requests if r.path == CHAT_PATH]
    assert len(chats) == (3 + TASKS + 3) * 2
    # The second completion of every Task carries the tool's result as the last user message.
    seconds = [c for c in chats if c["messages"][-1]["content"].startswith("RESULT:")]
    assert len(seconds) == len(chats) // 2
    assert [c["model"] for c in chats[-6:]] == ["tiny:v1"] * 6
    assert "held-out success gain over base" in done.stdout and "side by side" in done.stdout
    assert (out_dir / "demo-reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_all_gone(run_dir, report)


def test_bad_version_option_shows_the_inverted_reward_version_rolled_back(tmp_path, vllm):
    """--bad-version on the fake vLLM (scripted trainer): round on base, v1 promoted by the demo as an operator
    would, round on v1, a training round with inverted published rewards, v2 the canary's candidate, then canary
    Tasks with true rewards until the decision loop rolls v2 back. The fake answers in plain words for base and v1
    and in digits for v2 (as an adapter trained on inverted rewards would), so v2's true reward is 0."""
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    vllm.reply = Reply(content="plain words only")
    vllm.reply_for_model("tiny:v2", Reply(content="1234567890"))

    done = subprocess.run(demo_argv(vllm, run_dir, out_dir, "--bad-version", "--canary-min-tasks", "3"),
                          cwd=REPO_ROOT, env=demo_env(), capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)

    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    report = json.loads((out_dir / "demo-report.json").read_text())
    assert report["status"] == "completed" and [v["policy"] for v in report["versions"]] == ["base", "v1"]
    check = report["rollout_check"]
    assert (check["candidate"], check["active"]) == ("tiny:v2", "tiny:v1")
    assert (check["outcome"], check["reason"], check["by"]) == ("rolled_back", "regression", "auto"), check
    assert check["ci95"][1] < 0 and check["reward_delta"] == -1.0
    service = check["service_arms"]
    assert service["candidate"]["reward"]["n"] >= 3 and service["active"]["reward"]["n"] >= 3
    demo = check["demo_arms"]
    assert (demo["candidate"]["mean_reward"], demo["active"]["mean_reward"]) == (0.0, 1.0)
    assert demo["candidate"]["tasks"] + demo["active"]["tasks"] == check["canary_tasks"]
    runs = report["timings"]["training_runs"]
    assert [(r["lora_name"], r.get("candidate", False)) for r in runs] == [("tiny:v1", False), ("tiny:v2", True)]
    assert [r["sample_count"] for r in runs] == [TASKS * TURNS] * 2  # v2: the inverted round's samples only
    # The bad round's Tasks published 1 - r (0 for these answers): what v2 was trained on.
    rewards = [json.loads(line) for line in (run_dir / "agents.jsonl").read_text().splitlines()]
    bad_round = [x for x in rewards if x["round"] == 2]
    assert len(bad_round) == TASKS and all(x["reward"] == 1.0 and x["policy"] == "tiny:v1" for x in bad_round)
    # Every canary Task was pinned to v1 or v2 and served by it; v2 is unloaded once no Task holds it.
    canary = [x for x in rewards if x["round"] >= 3]
    assert {x["policy"] for x in canary} == {"tiny:v1", "tiny:v2"} and len(canary) == check["canary_tasks"]
    assert "decision: rolled_back (regression, by auto)" in done.stdout
    assert "tiny:v2" not in vllm.loaded
    assert_all_gone(run_dir, report)


def test_make_demo_shows_held_out_success_per_version_the_gain_and_answers_side_by_side(tmp_path):
    """`make demo`'s path, shortened: its own driver arguments (SmolLM2's calculator family, two Training Runs), with
    the fake vLLM serving `smollm2` and the scripted trainer instead of the real model and the local trainer, and
    smaller batches. The fake answers every held-out problem wrong on base and v1 and the first one right on v2, so
    the report must show v2's gain over base and that problem in the side-by-side answers."""
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    held_out = calc.problems("held-out", 3, 0)
    right = [p.answer == held_out[0].answer for p in held_out]
    with FakeVLLM(served_model="smollm2", name="vllm-fake") as vllm:
        vllm.reply = Reply(content="CALL calc(6*7)")  # a valid call, never a final answer
        vllm.reply_for_model("smollm2:v2", Reply(content=f"ANSWER: {held_out[0].answer}"))
        argv = [sys.executable, "-m", DEMO_MODULE, *make_demo_args(), "--instances", vllm.url, "--trainer",
                "scripted", "--tasks", str(TASKS), "--eval-tasks", "3", "--concurrency", "2", "--run-dir",
                str(run_dir), "--out-dir", str(out_dir)]

        done = subprocess.run(argv, cwd=REPO_ROOT, env=demo_env(), capture_output=True, text=True,
                              timeout=DEMO_TIMEOUT_S)
        chats = [r.body for r in vllm.requests if r.path == CHAT_PATH]

    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    report = json.loads((out_dir / "demo-report.json").read_text())
    settings = report["settings"]
    assert (settings["family"], settings["model_id"], settings["rounds"]) == ("calculator", "smollm2", 2)
    assert [v["policy"] for v in report["versions"]] == ["base", "v1", "v2"]
    for version, successes in zip(report["versions"], ([False] * 3, [False] * 3, right)):
        assert [a["success"] for a in version["answers"]] == successes
        assert version["success_rate"] == round(sum(successes) / 3, 4)
        lo, hi = version["success_ci95"]
        assert lo <= version["success_rate"] <= hi
    gain = round(sum(right) / 3, 4)
    assert [(g["policy"], g["success_minus_base"]) for g in report["success_gains"]] == [("v1", 0.0), ("v2", gain)]
    assert report["success_gains"][1]["ci95"][0] <= gain <= report["success_gains"][1]["ci95"][1]
    # The same held-out problems for every version; the last evaluation was served by v2.
    assert len({tuple(a["question"] for a in v["answers"]) for v in report["versions"]}) == 1
    assert [c["model"] for c in chats[-6:]] == ["smollm2:v2"] * 6
    timings = report["timings"]
    assert timings["preparation"]["before_driver_s"] >= 0 and timings["preparation"]["model_conversion_s"] is None
    assert 0 < timings["demo_seconds"] <= timings["total_seconds"]
    # What a reader sees at the end: the table with intervals, the gain per version, the answers side by side.
    out = done.stdout
    assert "success" in out and "95% CI" in out and "shaped reward" in out
    assert f"  v2  {gain:+.3f}  [" in out.split("held-out success gain over base (95% CI):", 1)[1]
    side = out.split("held-out problems, base vs v2: ", 1)[1]
    assert side.startswith(f"wrong → right {sum(right)}, right → wrong 0")
    assert f"Q: {held_out[0].question} (answer {held_out[0].answer})" in side
    assert f"v2 [right, reward 1.0]: 'ANSWER: {held_out[0].answer}'" in side
    assert "time: the demo " in out and "preparation, not counted in the demo's time: " in out
    assert_all_gone(run_dir, report)


def test_two_lineages_learn_side_by_side_each_on_its_own_line(tmp_path, vllm):
    """`make demo-tiny DEMO_ARGS="--lineages 2"`, shortened: `plain` and `symbols` run their Tasks interleaved, each
    Task pinned to its own line; each lineage gets its own Training Run and version, started by the RL Service's
    automatic training (the driver calls no route that starts a run); one table per lineage."""
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    eval_tasks = 3
    done = subprocess.run(demo_argv(vllm, run_dir, out_dir, "--lineages", "2", "--eval-tasks", str(eval_tasks)),
                          cwd=REPO_ROOT, env=demo_env(), capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)

    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    report = json.loads((out_dir / "demo-report.json").read_text())
    assert report["status"] == "completed" and report["settings"]["lineages"] == 2
    lineages = report["lineages"]
    assert sorted(lineages) == ["plain", "symbols"]
    for name, section in lineages.items():
        assert section["line"] == f"tiny:{name}"
        assert [(v["policy"], v["lora_name"]) for v in section["versions"]] == [
            ("base", None), ("v1", f"tiny:{name}:v1")]
        for v in section["versions"]:
            assert v["tasks"] == eval_tasks and len(v["task_success"]) == eval_tasks
            lo, hi = v["success_ci95"]
            assert lo <= v["success_rate"] <= hi
        assert [g["policy"] for g in section["success_gains"]] == ["v1"]
    # The fake vLLM answers in plain words ("Hello from the fake vLLM."): a success for `plain`, a failure for
    # `symbols`, so each table measures its own lineage's objective.
    assert all(v["success_rate"] == 1.0 for v in lineages["plain"]["versions"])
    assert all(v["success_rate"] == 0.0 for v in lineages["symbols"]["versions"])
    # Each lineage's Training Run claimed its own training Tasks' samples only (evaluation Tasks are never claimed).
    runs = {r["lineage"]: r for r in report["timings"]["training_runs"]}
    assert {k: (r["lora_name"], r["sample_count"]) for k, r in runs.items()} == {
        "plain": ("tiny:plain:v1", TASKS * TURNS), "symbols": ("tiny:symbols:v1", TASKS * TURNS)}
    # Every run was started by the scheduler for its own lineage once a round of its samples was pending (the
    # trigger is the RL Service's record, copied by the driver), never by an operator call: the scheduler logged
    # each start, and no `POST /v1/rl/training/runs` reached the RL Service (the gateway logs every request it
    # forwards to it: the driver's run listings are there, a run start is not).
    rl_config = yaml.safe_load((run_dir / "gateway" / "rl-service.yaml").read_text())
    assert rl_config["training_policy"] == {"auto": True, "min_pending_samples": TASKS * TURNS,
                                            "poll_interval_seconds": 1.0}
    service_log = (run_dir / "gateway" / "rl-service.log").read_text()
    for name, run in runs.items():
        assert run["trigger"]["kind"] == "auto" and run["trigger"]["lineage"] == name, run
        assert run["trigger"]["reason"] == "min_pending_samples" and run["trigger"]["eligible_samples"] == \
            TASKS * TURNS
        assert f"automatic training run {run['training_run_id']} started for tiny:{name} " in service_log
        assert lineages[name]["versions"][1]["trigger"] == run["trigger"]
        assert f"v1: Training Run {run['training_run_id']}, trigger auto (min_pending_samples)" in done.stdout
    forwarded = [line for line in (run_dir / "gateway" / "gateway.log").read_text().splitlines()
                 if "HTTP Request: " in line and "/v1/rl/training/runs" in line]
    assert any(" GET " in line for line in forwarded)
    assert not [line for line in forwarded if " POST " in line]
    # Both lineages' Tasks ran on base first, then each on its own adapter: never the other lineage's.
    served = [r.body["model"] for r in vllm.requests if r.path == CHAT_PATH]
    per_round = (eval_tasks + TASKS) * TURNS * 2
    assert served[:per_round] == ["tiny"] * per_round
    assert sorted(set(served[per_round:])) == ["tiny:plain:v1", "tiny:symbols:v1"]
    assert served[per_round:].count("tiny:plain:v1") == served[per_round:].count("tiny:symbols:v1") == \
        eval_tasks * TURNS
    agents = [json.loads(line) for line in (run_dir / "agents.jsonl").read_text().splitlines()]
    assert all(a["policy"] in ("base", f"tiny:{a['lineage']}:v1") for a in agents)
    for name in ("plain", "symbols"):
        assert f"lineage {name} (tiny:{name})" in done.stdout
    assert "held-out success gain over base" in done.stdout
    assert_all_gone(run_dir, report)


def test_two_task_families_as_two_lineages_end_with_the_cross_table(tmp_path, vllm):
    """`make demo-real DEMO_ARGS="--lineages 2"`, shortened, on the fake vLLM: lineage `calculator` runs the calculator
    family, lineage `sentiment` the review-sentiment family, each trained automatically on its own samples (a
    calculator Task leaves two, a sentiment Task one); then each lineage's last version answers the OTHER family's
    held-out problems, pinned to its own adapter, and the report ends with the cross table."""
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    eval_tasks = 3
    argv = demo_argv(vllm, run_dir, out_dir, "--family", "calculator", "--model-id", "tiny", "--lineages", "2",
                     "--eval-tasks", str(eval_tasks))
    # No calculator call (every calculator Task fails); "positive" is right for every other review (they alternate).
    vllm.reply = Reply(content="SENTIMENT: positive")
    done = subprocess.run(argv, cwd=REPO_ROOT, env=demo_env(), capture_output=True, text=True,
                          timeout=DEMO_TIMEOUT_S)

    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    report = json.loads((out_dir / "demo-report.json").read_text())
    lineages = report["lineages"]
    assert {name: section["family"] for name, section in lineages.items()} == {
        "calculator": "calculator", "sentiment": "sentiment"}
    runs = {r["lineage"]: r for r in report["timings"]["training_runs"]}
    assert {k: (r["lora_name"], r["sample_count"], r["trigger"]["kind"]) for k, r in runs.items()} == {
        "calculator": ("tiny:calculator:v1", TASKS * 2, "auto"), "sentiment": ("tiny:sentiment:v1", TASKS, "auto")}
    rl_config = yaml.safe_load((run_dir / "gateway" / "rl-service.yaml").read_text())
    assert rl_config["training_policy"]["lineages"] == {"sentiment": {"min_pending_samples": TASKS}}
    for name, section in lineages.items():
        assert [v["policy"] for v in section["versions"]] == ["base", "v1"]
        assert all(v["tasks"] == eval_tasks for v in section["versions"])
        assert [v["success_rate"] for v in section["versions"]] == ([0.0, 0.0] if name == "calculator" else
                                                                   [round(2 / 3, 4)] * 2)
    assert lineages["sentiment"]["versions"][0]["reasons"] == {"right answer": 2, "wrong answer": 1}
    assert lineages["calculator"]["versions"][0]["reasons"] == {"no ANSWER:": eval_tasks}

    cross = report["lineages_cross"]
    assert cross["families"] == ["calculator", "sentiment"]
    assert [r["row"] for r in cross["rows"]] == ["base", "calculator v1", "sentiment v1"]
    assert cross["rows"][1]["families"]["sentiment"]["success_rate"] == round(2 / 3, 4)
    for row in cross["rows"][1:]:
        assert sorted(row["families"]) == ["calculator", "sentiment"]
        for cell in row["families"].values():
            assert cell["tasks"] == eval_tasks and cell["gain_over_base"] == 0.0
            lo, hi = cell["gain_ci95"]
            assert lo <= 0.0 <= hi
    assert "cross table: each lineage's last version on both families" in done.stdout

    # Who served what: the cross evaluation's Tasks carry the other family's prompts to their OWN lineage's adapter.
    chats = [r.body for r in vllm.requests if r.path == CHAT_PATH]
    system = {c["model"]: set() for c in chats}
    for c in chats:
        system[c["model"]].add(c["messages"][0]["content"][:20])
    calc_prompt, sent_prompt = calc.SYSTEM_PROMPT[:20], sent.SYSTEM_PROMPT[:20]
    assert system["tiny:calculator:v1"] == {calc_prompt, sent_prompt}
    assert system["tiny:sentiment:v1"] == {calc_prompt, sent_prompt}
    cross_chats = chats[-(eval_tasks * 2 + eval_tasks):]  # last batch: 3 sentiment Tasks x 1 + 3 calculator x 2
    assert sorted((c["model"], c["messages"][0]["content"][:20]) for c in cross_chats) == sorted(
        [("tiny:calculator:v1", sent_prompt)] * eval_tasks + [("tiny:sentiment:v1", calc_prompt)] * eval_tasks * 2)
    agents = [json.loads(line) for line in (run_dir / "agents.jsonl").read_text().splitlines()]
    assert all(a["policy"] in ("base", f"tiny:{a['lineage']}:v1") for a in agents)
    assert_all_gone(run_dir, report)
