"""Tasks: the record, its state machines and the Redis registry that moves them atomically."""
