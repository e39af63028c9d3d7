"""Model helpers. `tiny` writes a small random Qwen2 model for tests and the demo (no download, lazy imports)."""

from .tiny import make_tiny_model

__all__ = ["make_tiny_model"]
