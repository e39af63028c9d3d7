"""Several RL Service processes on one port: the supervisor, the leader lease and the leader-only routes."""
