"""Project gateway (CONTRACT §3): signed control API, inference proxy with capture, LoRA lifecycle, RL supervision."""
