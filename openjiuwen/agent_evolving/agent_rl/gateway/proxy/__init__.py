"""The inference proxy (CONTRACT §3.5-§3.7): OpenAI and Anthropic shapes, SSE, stream aggregation, the request
checks inside a Task, and the gateway's side of the capture hooks for one proxied call."""
