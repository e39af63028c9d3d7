"""Thin FastAPI routers, the error envelope and the ASGI guards (auth, body size)."""
