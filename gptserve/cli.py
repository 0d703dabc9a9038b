"""The `gptserve` command: one subcommand a program, each with its own `--help`.

    gptserve serve      the OpenAI-compatible server (python -m gptserve.server)
    gptserve generate   offline generation in the terminal (python -m gptserve.engine)
    gptserve train      train a model or a LoRA adapter (gptserve train in a checkout)
    gptserve ray        the server's replicas on Ray Serve (python -m gptserve.server.ray)
    gptserve fetch      fetch the default model and build the CPU kernels ahead of a start
    gptserve export     write a model, its LoRA adapter merged, as a GGUF file (gptserve.export)

A subcommand's module is imported only when it runs, so `gptserve --help` is quick.
"""

from __future__ import annotations

import importlib
import sys

from gptserve import __version__

# name: (module with main(argv) -> int, one line for --help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gptserve.server.cli", "serve a model over OpenAI's API (and the playground)"),
    "generate": ("gptserve.engine.cli", "generate text for a prompt in the terminal"),
    "train": ("gptserve.training.cli", "train a model, or a LoRA adapter, on text"),
    "ray": ("gptserve.server.ray.cli", "serve replicas on Ray Serve"),
    "fetch": ("gptserve.fetch", "fetch models and build the CPU kernels ahead of a start"),
    "export": ("gptserve.export", "write a model, its LoRA adapter merged, as a GGUF file"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    return "\n".join(
        [
            "usage: gptserve COMMAND [ARGS...]",
            "",
            "commands:",
            *lines,
            "",
            "`gptserve COMMAND --help` lists a command's flags.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] == "--version":
        print(f"gptserve {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(
            f"error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr
        )
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    code = module.main(rest)
    if name == "train":
        module.leave(code)  # torchrun's workers leave without teardown (training/cli.py)
    return code
