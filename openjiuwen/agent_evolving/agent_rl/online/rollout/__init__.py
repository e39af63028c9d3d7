"""Safe rollout of new policy versions: canary, automatic promotion or rollback, operator control (docs/rollout.md)."""
