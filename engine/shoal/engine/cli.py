"""`shoal` command line: one entry point, subcommands dispatched lazily.

Each subcommand lives in its own module and is imported only when chosen, so `shoal --help`
and the operator's use of this package never import torch.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help). The module exposes `main(argv: list[str]) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("shoal.engine.entrypoints.serve", "Serve a model over an OpenAI-compatible HTTP API."),
    "make-model": ("shoal.engine.model_maker", "Write the project's small Llama model to a directory."),
    "gateway": ("shoal.engine.router.gateway", "Route by model across every InferenceEngine (fleet gateway)."),
}


def _usage() -> str:
    lines = ["usage: shoal <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `shoal <command> --help` for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"shoal: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
