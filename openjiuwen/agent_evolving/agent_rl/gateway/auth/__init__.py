"""Who may call what: HMAC-signed control requests (CONTRACT §3.2), access to a lineage's versions outside a Task,
and per-Task capture secrets."""
