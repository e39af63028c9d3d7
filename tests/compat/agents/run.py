"""Runs one framework's agents for the compatibility suite, inside `.venv-compat` (never the project's environment:
nothing here imports the project or its tests).

    .venv-compat/bin/python tests/compat/agents/run.py openai_agents

Loads `tests/compat/agents/<framework>_agents.py` (never named like the framework's own package, which it imports):
its `PACKAGES` and its `PATTERNS` (name → async function of a `Target`). Prints one JSON line `{"versions":
{package: version}}`, then answers each JSON line read on stdin, `{"pattern", "base_url", "session"}`, with one line:
`{"output": …}` (what the agent finished with) or `{"error": "Type: message"}`. One process serves every run of its framework, so each framework is imported once.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

MODEL = "tiny"


@dataclass(frozen=True)
class Target:
    """Where an agent sends its calls: the gateway, under its own session id (mapped to a Task or not)."""

    base_url: str  # the gateway, e.g. http://127.0.0.1:8080 (OpenAI clients add /v1 themselves where they must)
    session: str
    model: str = MODEL

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Agent-Session-Id": self.session}

    @property
    def openai_base(self) -> str:
        return self.base_url + "/v1"


def _load(framework: str):
    sys.path.insert(0, str(Path(__file__).parent))  # the agents' shared `common` module
    path = Path(__file__).with_name(f"{framework}_agents.py")
    spec = importlib.util.spec_from_file_location(f"compat_{framework}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    module = _load(sys.argv[1])
    versions = {name: importlib.metadata.version(name) for name in module.PACKAGES}
    print(json.dumps({"versions": versions}), flush=True)
    loop = asyncio.new_event_loop()  # one loop for every run, as in an application (clients cache connections)
    for line in sys.stdin:
        job = json.loads(line)
        target = Target(job["base_url"], job["session"])
        try:
            output = loop.run_until_complete(module.PATTERNS[job["pattern"]](target))
            answer = {"output": output}
        except Exception as exc:  # the harness reports it: an agent that fails is the finding
            traceback.print_exc(file=sys.stderr)
            answer = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(json.dumps(answer, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
