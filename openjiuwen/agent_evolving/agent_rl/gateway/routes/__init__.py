"""The gateway's HTTP surface, one router per route family (CONTRACT §3): each handler is a thin call into the parts
built by `gateway/assembly.py`; authentication is a router dependency (deps.py), errors are mapped in app.py."""
