"""The vLLM instances behind the gateway (CONTRACT §3.9): the registry of static and registered instances, which
addresses a registration may name, and the health probes that take a dead instance out of routing."""
