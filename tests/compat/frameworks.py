"""The compatibility suite's runs (tests/compat/test_frameworks.py) and the page they render (docs/compatibility.md).

`RUNS` lists each agent pattern: the framework module under tests/compat/agents/ and its pattern, the route it calls,
and the constraint kinds its completions carry inside a Task (what `sampling.constraints` must record: the union over
the run's completions). `AgentProcess` drives one framework's agents in `.venv-compat` over the line protocol of
tests/compat/agents/run.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COMPAT_PYTHON = Path(os.environ.get("RL_TEST_COMPAT_PYTHON") or ROOT / ".venv-compat" / "bin" / "python")
AGENTS = Path(__file__).resolve().parent / "agents"
PAGE = ROOT / "docs" / "compatibility.md"


@dataclass(frozen=True)
class Run:
    framework: str  # module under tests/compat/agents/
    pattern: str  # its PATTERNS key
    label: str  # the framework as a user knows it
    what: str  # the pattern, as the page shows it
    route: str  # "openai" (/v1/chat/completions) or "anthropic" (/v1/messages)
    kinds: frozenset[str] = field(default_factory=frozenset)  # sampling.constraints kinds inside a Task

    @property
    def id(self) -> str:
        return f"{self.framework}.{self.pattern}"


def _run(framework: str, pattern: str, label: str, what: str, route: str = "openai", *kinds: str) -> Run:
    return Run(framework, pattern, label, what, route, frozenset(kinds))


RUNS: tuple[Run, ...] = (
    _run("openai_sdk", "greedy", "openai SDK", "`temperature=0`", "openai", "greedy"),
    _run("openai_sdk", "json_schema", "openai SDK", "`chat.completions.parse(response_format=Model)` (json_schema)",
         "openai", "json_schema"),
    _run("openai_sdk", "tools", "openai SDK", "tool loop"),
    _run("openai_sdk", "tool_required", "openai SDK", "`tool_choice=\"required\"`", "openai", "tool_required"),
    _run("openai_sdk", "stream", "openai SDK", "streamed answer"),
    _run("openai_agents", "tools", "OpenAI Agents SDK", "function tool (strict by default)", "openai",
         "strict_tools"),
    _run("openai_agents", "output_type", "OpenAI Agents SDK", "`Agent(output_type=Model)`", "openai", "json_schema"),
    _run("openai_agents", "stream_tools", "OpenAI Agents SDK", "`Runner.run_streamed`, function tool", "openai",
         "strict_tools"),
    _run("langchain", "tools", "LangChain", "`bind_tools` tool loop"),
    _run("langchain", "structured", "LangChain", "`with_structured_output(Model)` (default method)", "openai",
         "json_schema"),
    _run("langchain", "stream", "LangChain", "`astream`"),
    _run("langchain", "langgraph_react", "LangGraph", "`create_react_agent` with a tool"),
    _run("langchain", "langgraph_react_structured", "LangGraph", "`create_react_agent(response_format=Model)`",
         "openai", "json_schema"),
    _run("langchain", "langgraph_stream", "LangGraph", "`create_react_agent`, `astream`"),
    _run("langchain", "anthropic_structured", "LangChain (langchain-anthropic)",
         "`ChatAnthropic.with_structured_output(Model)`", "anthropic", "tool_named"),
    _run("pydantic_ai", "tools", "pydantic-ai", "tools (strict when their schema allows)", "openai",
         "strict_tools"),
    _run("pydantic_ai", "output_type", "pydantic-ai", "`Agent(output_type=Model)` (tool output)", "openai",
         "tool_required", "strict_tools"),
    _run("pydantic_ai", "tools_output_type", "pydantic-ai", "tools and `output_type=Model`", "openai",
         "tool_required", "strict_tools"),
    _run("pydantic_ai", "stream", "pydantic-ai", "`run_stream` with tools", "openai", "strict_tools"),
    _run("pydantic_ai", "anthropic_output_type", "pydantic-ai (AnthropicModel)", "tools and `output_type=Model`",
         "anthropic", "tool_required"),
    _run("autogen", "tools", "AutoGen", "`AssistantAgent` with a tool, `reflect_on_tool_use`"),
    _run("autogen", "structured", "AutoGen", "`AssistantAgent(output_content_type=Model)`", "openai",
         "json_schema"),
    _run("autogen", "stream", "AutoGen", "`model_client_stream=True`, tool"),
    _run("llama_index", "tools", "LlamaIndex", "`FunctionAgent` with a tool (`OpenAILike`)"),
    _run("llama_index", "structured", "LlamaIndex", "`astructured_predict(Model)` (a forced function call)",
         "openai", "tool_required", "single_tool_call"),
    _run("llama_index", "stream", "LlamaIndex", "`astream_chat`"),
    _run("anthropic_sdk", "tools", "anthropic SDK", "tool use loop", "anthropic"),
    _run("anthropic_sdk", "stream_tools", "anthropic SDK", "`messages.stream` tool use loop", "anthropic"),
    _run("anthropic_sdk", "tool_any", "anthropic SDK", "`tool_choice={\"type\": \"any\"}`", "anthropic",
         "tool_required"),
)


class AgentProcess:
    """One framework's agents in `.venv-compat` (tests/compat/agents/run.py), answering one run per call."""

    def __init__(self, framework: str, log_dir: Path) -> None:
        self.framework = framework
        self.log_path = log_dir / f"{framework}.stderr.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(COMPAT_PYTHON), str(AGENTS / "run.py"), framework], cwd=ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
            env={**os.environ, "OPENAI_API_KEY": "x", "ANTHROPIC_API_KEY": "x"},
        )
        self.versions: dict[str, str] = self._read()["versions"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"{self.framework} agents exited:\n{self.stderr()[-3000:]}")
        return json.loads(line)

    def run(self, pattern: str, base_url: str, session: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"pattern": pattern, "base_url": base_url, "session": session}) + "\n")
        return self._read()

    def stderr(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# ------------------------------------------------------------------------------------------------ the page


HEADER = """# Compatibility with agent frameworks

Generated by `tests/compat/test_frameworks.py` from its own run (do not edit by hand: `COMPAT_WRITE_PAGE=1
.venv/bin/python -m pytest tests/compat` rewrites it; the test fails when this page and the run differ).

Each agent is written as its framework's docs write one, runs in the test-only environment `.venv-compat`
(`requirements-compat.lock`, created by `make test`), and talks to the reference gateway and its RL Service over real
sockets. The model behind them is the fake vLLM of the tests (tests/support/fake_vllm.py, answering in vLLM 0.32's
recorded shapes, tests/fixtures/vllm-0.32-cpu, as a server started with `--enable-auto-tool-choice` does), driven by a
fake model that follows the conversation (tests/support/agent_model.py). Every agent runs twice: outside a Task, then
inside one (its session mapped to an active Task).

- **served**: the agent finished inside the Task exactly as outside it (same final output, same number of model
  calls, each upstream request the one sent outside plus the capture flags only).
- **captured**: the completions captured into the Task, and the constraint kinds recorded in their
  `sampling.constraints` (docs/gateway.md, "Request fields inside a Task").
- **trained as**: what the default `constrained_samples` policy does with them: trained on-policy, trained off-policy
  with the correction (`correct`: truncated importance weights against the captured processed logprobs), or kept out
  of training (`exclude`; docs/training.md).

One structured-output agent also runs against a real vLLM (CPU build): `tests/system/test_constrained_real_vllm.py`.

Found while writing the agents:

- The current `llama-index-llms-openai` (0.8.3) caps `openai<3`, while the current OpenAI Agents SDK and pydantic-ai
  need `openai>=3`: no resolver installs all the current releases together. The lock holds the resolved set with
  openai 3 and is installed with `--no-deps`; LlamaIndex's three agents run on it.
- The `anthropic` SDK's `messages.create` (2.x) takes no `temperature`, so greedy decoding is tried on the OpenAI route.
- `langchain-anthropic` (max_tokens 4096) and pydantic-ai's `AnthropicModel` (16384) ask for more tokens than a
  1024-token model holds by default; vLLM's 400 reaches the agent unchanged inside a Task as outside. The agents set
  256, as one does for a small model.
- The tool-choice and strictness each framework sends by default: the Agents SDK marks function tools `strict`;
  pydantic-ai marks its tools `strict` when their schema allows it on the OpenAI route (not on the Anthropic one) and
  forces its output tool (`tool_choice: required`); LangChain's and the Agents SDK's structured output use
  `response_format` json_schema, `ChatAnthropic.with_structured_output` a named tool; LlamaIndex's structured
  prediction forces one call (`required` with `parallel_tool_calls: false`) and samples at temperature 0.1.
"""


def render(versions: dict[str, str], rows: list[dict[str, Any]]) -> str:
    lines = [HEADER, "## Versions", "", "| package | version |", "|---|---|"]
    lines += [f"| `{name}` | {version} |" for name, version in sorted(versions.items())]
    lines += ["", "## Agents", "", "| framework | pattern | route | served | captured | trained as |",
              "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['framework']} | {row['pattern']} | {row['route']} | {row['served']} | "
                     f"{row['captured']} | {row['trained']} |")
    return "\n".join(lines) + "\n"
