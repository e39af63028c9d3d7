"""Request headers from the gateway (or an AIGW) to the RL Service (CONTRACT §2.4, §2.5, §2.8), lower-case as ASGI
and httpx give them."""

from __future__ import annotations

# The agent's session: the key to capture on the gateway, and the Task's session on its start.
SESSION_ID = "x-agent-session-id"
# Task start: the Task id the gateway minted, and the policy it pinned the Task to.
TASK_ID = "x-aigw-rl-task-id"
POLICY_NAME = "x-aigw-rl-policy-name"
POLICY_MODEL = "x-aigw-rl-policy-model"
# ext: on a Task start the agent key that starts it, on a stop or reward the agent key that calls; absent for
# operator calls (and from an AIGW, which has no agent keys).
AGENT_KEY = "x-aigw-rl-agent-key"
# ext (docs/lineages.md wire 1, 2): the Task's lineage, always sent (`default` included) by a gateway that pins
# Tasks per lineage; its absence means a gateway without lineages (an AIGW).
LINEAGE = "x-aigw-rl-lineage"
# ext (docs/lineages.md "Lifecycle"): on a Task start with an agent key that has a cap, the number of lineages that
# key may register (`agentHmacKeys[i].maxLineages`); absent = no cap.
MAX_LINEAGES = "x-aigw-rl-max-lineages"


def display(name: str) -> str:
    """A header name as the contract and the published API schema write it (`X-AIGW-RL-Task-Id`); HTTP compares
    header names without case, so this is only how they are shown."""
    return "-".join(part.upper() if part in ("x", "aigw", "rl") else part.capitalize() for part in name.split("-"))
