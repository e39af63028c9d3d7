"""Environment variables of the RL Service process that its supervising gateway (or an operator) sets."""

from __future__ import annotations

# The bearer token every route but `GET /health` requires; the gateway sets a fresh one for each child.
SERVICE_TOKEN = "RL_SERVICE_TOKEN"
# The config file, where no `--config` is given (and under the uvicorn factory).
SERVICE_CONFIG = "RL_SERVICE_CONFIG"
