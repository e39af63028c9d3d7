"""Fault injection points (online/faults.py): off by default, parsed strictly, exit only at the named hit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from openjiuwen.agent_evolving.agent_rl.online.faults import CRASH_EXIT_CODE, POINTS, CrashAt, fault_hook, no_faults


def test_unset_or_blank_is_the_no_op_hook():
    assert fault_hook(None) is no_faults and fault_hook("") is no_faults and fault_hook("  ") is no_faults
    for point in POINTS:
        assert no_faults(point) is None


@pytest.mark.parametrize("spec", ["nowhere", "capture.committed@0", "capture.committed@x", "run.claimed@-1"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError):
        fault_hook(spec)


def test_parse_counts_hits_of_its_own_point_only():
    hook = CrashAt.parse("reward.inserted@3")
    assert (hook.point, hook.after) == ("reward.inserted", 3)
    hook("capture.committed")
    hook("reward.inserted")
    hook("reward.inserted")
    assert hook.hits == 2  # the third hit would exit


def test_the_nth_hit_exits_the_process_at_once():
    code = (
        "from openjiuwen.agent_evolving.agent_rl.online.faults import fault_hook\n"
        "hook = fault_hook('run.marked@2')\n"
        "hook('run.marked'); print('first', flush=True)\n"
        "try:\n"
        "    hook('run.marked')\n"
        "finally:\n"
        "    print('finally ran', flush=True)\n"  # os._exit skips it, as a SIGKILL would
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (CRASH_EXIT_CODE, "first\n")


def test_stop_freezes_the_process_at_the_nth_hit_and_it_goes_on_once_continued():
    """`stop:` SIGSTOPs the process instead of ending it; SIGCONT resumes it on the next line, and later hits do
    nothing (a frozen leader resumes once)."""
    import os
    import signal
    import time

    code = (
        "from openjiuwen.agent_evolving.agent_rl.online.faults import fault_hook\n"
        "hook = fault_hook('stop:run.activated@2')\n"
        "hook('run.activated'); print('first', flush=True)\n"
        "hook('run.activated'); print('continued', flush=True)\n"
        "hook('run.activated'); print('third', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "first\n"
        for _ in range(400):  # until the kernel reports it stopped (state T in /proc)
            if open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T":
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the process never stopped itself")
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
    assert (proc.returncode, out) == (0, "continued\nthird\n")
    assert CrashAt.parse("stop:run.activated@2").stop and not CrashAt.parse("run.activated").stop


def test_the_process_hook_is_installed_once_from_the_environment_and_reached_by_point_name():
    """One seam: `install_from_env` sets the process's hook, every part reaches a point through `reached`."""
    code = (
        "from openjiuwen.agent_evolving.agent_rl.online import faults\n"
        "faults.reached('task.finalized'); print('off', flush=True)\n"  # nothing installed: no fault
        "faults.install_from_env({'ONLINE_RL_CRASH_AT': 'task.finalized@2'})\n"
        "faults.reached('capture.committed'); faults.reached('task.finalized'); print('first', flush=True)\n"
        "faults.reached('task.finalized'); print('not reached', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (CRASH_EXIT_CODE, "off\nfirst\n")


def test_a_malformed_spec_in_the_environment_is_refused():
    from openjiuwen.agent_evolving.agent_rl.online import faults

    with pytest.raises(ValueError):
        faults.install_from_env({"ONLINE_RL_CRASH_AT": "nowhere"})


def test_every_point_is_reached_by_name_and_no_part_takes_a_hook():
    """Each documented point is passed by the service code through `faults.reached`, and no constructor or
    function of the service takes a fault hook any more (the seam is faults.py's, not threaded)."""
    import ast
    from pathlib import Path

    from openjiuwen.agent_evolving.agent_rl.online import faults

    root = Path(faults.__file__).resolve().parent
    reached: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "reached" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "faults":
                assert isinstance(node.args[0], ast.Constant) and node.args[0].value in POINTS, ast.unparse(node)
                reached.add(node.args[0].value)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and path.name != "faults.py":
                hooks = [a.arg for a in (*node.args.args, *node.args.kwonlyargs)
                         if a.annotation is not None and "FaultHook" in ast.unparse(a.annotation)]
                assert not hooks, f"{path.name}:{node.lineno} {node.name} takes a fault hook"
    assert reached == set(POINTS)
