"""Names of policies that every process agrees on."""

from __future__ import annotations

# The policy of the base model with no LoRA adapter: what a Task or a sample runs on before any Training Run
# succeeded, the parent of the first Training Run, and the answer the gateway gives when no version is active.
BASE_POLICY = "base"
