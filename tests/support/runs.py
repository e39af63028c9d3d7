"""Test helpers around the Training Runner."""

from __future__ import annotations

import asyncio

from openjiuwen.agent_evolving.agent_rl.online.training.run_records import TrainingRun
from openjiuwen.agent_evolving.agent_rl.online.training.runner import TrainingRunner


async def wait_for_run(runner: TrainingRunner, run_id: str) -> TrainingRun:
    """Wait for this process's execution of a run to end; then return the record."""
    task = runner._executions.task(run_id)  # noqa: SLF001 - the runner keeps no public handle on it
    if task is not None:
        await asyncio.gather(asyncio.shield(task), return_exceptions=True)
    return await runner.get(run_id)
