"""The lineage a Task start names (gateway/rl/task_lineage.py, docs/lineages.md wire 1)."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.common.lineage import InvalidLineage
from openjiuwen.agent_evolving.agent_rl.gateway.rl.task_lineage import decode_start_body, requested_lineage


@pytest.mark.parametrize(("body", "lineage"), [
    (b'{"reward_mode": "terminal"}', "default"),
    (b'{"lineage": "support"}', "support"),
    (b'{"lineage": "default"}', "default"),
    (b"not json", "default"),  # the RL Service refuses such a body in its own words
    (b"[1]", "default"),
])
def test_the_lineage_of_a_start_body(body: bytes, lineage: str) -> None:
    assert requested_lineage(decode_start_body(body)) == lineage


@pytest.mark.parametrize("value", [b'"Support"', b'"v3"', b'""', b"null", b"7", b'"a:b"', b'"' + b"x" * 64 + b'"'])
def test_a_malformed_lineage_is_refused(value: bytes) -> None:
    with pytest.raises(InvalidLineage):
        requested_lineage(decode_start_body(b'{"lineage": ' + value + b"}"))
