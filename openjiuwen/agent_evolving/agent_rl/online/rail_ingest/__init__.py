"""rail-v1: agent-side uploads of already tokenized samples, staged per session and judged on feedback (§4.6)."""
