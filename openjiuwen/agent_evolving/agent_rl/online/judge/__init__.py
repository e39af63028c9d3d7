"""The Judge: scores a reply from the conversation and the user's feedback over an OpenAI-compatible endpoint."""

from openjiuwen.agent_evolving.agent_rl.online.judge.parsing import parse_verdict
from openjiuwen.agent_evolving.agent_rl.online.judge.prompt import feedback_from_request, render_prompt
from openjiuwen.agent_evolving.agent_rl.online.judge.result import PROMPT_VERSION, Judge, JudgeResult
from openjiuwen.agent_evolving.agent_rl.online.judge.scorer import JudgeScorer, normalize_endpoint

__all__ = [
    "PROMPT_VERSION",
    "Judge",
    "JudgeResult",
    "JudgeScorer",
    "feedback_from_request",
    "normalize_endpoint",
    "parse_verdict",
    "render_prompt",
]
