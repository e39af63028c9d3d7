"""The `openjiuwen-rl` command."""
