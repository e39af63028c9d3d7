"""Where the suite's time goes, from pytest's JUnit XML (`--junitxml`): seconds per top folder and the slowest
modules, as the Markdown tables of docs/test-durations.md.

    .venv/bin/python -m tests.support.durations run.xml [--top 25]

A test's time is its setup, call and teardown (a module-scoped server is counted in the test that started it).
Under xdist the sums are worker-seconds: the wall time of a parallel run is printed by pytest, not here.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def module_seconds(junit: Path) -> tuple[Counter[str], Counter[str]]:
    """(seconds per module, tests per module), a module named by its dotted path (`tests.system.test_load`)."""
    seconds: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for case in ET.parse(junit).iter("testcase"):
        # classname is `tests.<folder>.<module>[.<Class>]`
        module = ".".join(case.get("classname", "").split(".")[:3])
        seconds[module] += float(case.get("time") or 0.0)
        counts[module] += 1
    return seconds, counts


def report(junit: Path, top: int) -> str:
    seconds, counts = module_seconds(junit)
    folders: Counter[str] = Counter()
    folder_counts: Counter[str] = Counter()
    for module, spent in seconds.items():
        folder = module.split(".")[1] if "." in module else module
        folders[folder] += spent
        folder_counts[folder] += counts[module]
    lines = ["| folder | tests | seconds |", "|---|---:|---:|"]
    lines += [f"| {name} | {folder_counts[name]} | {spent:.1f} |" for name, spent in folders.most_common()]
    lines.append(f"| all | {sum(folder_counts.values())} | {sum(folders.values()):.1f} |")
    lines += ["", "| module | tests | seconds |", "|---|---:|---:|"]
    lines += [f"| {name} | {counts[name]} | {spent:.1f} |" for name, spent in seconds.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.durations", description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path, help="a JUnit XML file written by pytest --junitxml")
    parser.add_argument("--top", type=int, default=25, help="how many of the slowest modules to list (default 25)")
    args = parser.parse_args(argv)
    print(report(args.junit, args.top))


if __name__ == "__main__":
    main()
