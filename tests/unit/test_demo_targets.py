"""The three demo targets run what README, docs/demo.md and `make help` say: `make demo` SmolLM2's calculator family
with two Training Runs, `make demo-tiny` the tiny model's words family, `make demo-real` three Training Runs; and
DEMO_ARGS given on the command line win (docs/demo.md's `--bad-version --rounds 1`). Read from dry runs of the
Makefile (`make -n` builds nothing and runs nothing), parsed by the driver's own parser."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.demo import run

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_MODULE = "openjiuwen.agent_evolving.agent_rl.demo"


def driver_args(target: str, demo_args: str = "") -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(["make", "--no-print-directory", "-n", target, f"DEMO_ARGS={demo_args}"], cwd=REPO_ROOT,
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    [line] = [line for line in dry.splitlines() if f" -m {DEMO_MODULE} " in f"{line} "]
    words = shlex.split(line)
    return words[words.index(DEMO_MODULE) + 1:]


@pytest.mark.parametrize(("target", "family", "model_id", "rounds"), [
    ("demo", "calculator", "smollm2", 2),
    ("demo-tiny", "words", "tiny", 8),
    ("demo-real", "calculator", "smollm2", 3),
])
def test_each_demo_target_runs_the_documented_family_and_training_runs(target, family, model_id, rounds):
    args = run.parse_args(driver_args(target))
    assert (args.family, args.model_id, args.rounds) == (family, model_id, rounds)
    # make reports its own preparation apart: it passes the time it started.
    assert args.preparation_started is not None


def test_demo_args_on_the_command_line_win_over_the_targets_defaults():
    args = run.parse_args(driver_args("demo-real", "--bad-version --rounds 1 --seed 4"))
    assert (args.family, args.rounds, args.seed, args.bad_version) == ("calculator", 1, 4, True)


def test_demo_tiny_keeps_one_lineage_unless_asked_for_two():
    assert run.parse_args(driver_args("demo-tiny")).lineages == 1
    args = run.parse_args(driver_args("demo-tiny", "--lineages 2"))
    assert (args.family, args.lineages, args.eval_tasks) == ("words", 2, 64)


def test_demo_real_runs_two_task_families_as_two_lineages_when_asked():
    args = run.parse_args(driver_args("demo-real", "--lineages 2"))
    assert (args.family, args.lineages, args.rounds, args.eval_tasks) == ("calculator", 2, 3, 64)
    args = run.parse_args(driver_args("demo-real", "--lineages 2 --rounds 2"))  # README's and docs/demo.md's run
    assert (args.family, args.lineages, args.rounds) == ("calculator", 2, 2)


@pytest.mark.parametrize("extra", [["--family", "calculator", "--bad-version"], ["--family", "words", "--bad-version"],
                                   ["--family", "words", "--lineages", "3"]])
def test_two_lineages_are_refused_where_the_demo_has_no_such_mode(extra, capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--lineages", "2", *extra] if "3" not in extra else extra)
    assert "--lineages" in capsys.readouterr().err
