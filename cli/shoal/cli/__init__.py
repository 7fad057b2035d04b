"""`shoal` command line: one entry point for every component, subcommands dispatched lazily.

Each subcommand lives in its component's package and is imported only when chosen, so
`shoal router` and `shoal gateway` run on the slim image (no torch) and `shoal --help` is cheap.
This package is the one place allowed to import every component (pyproject.toml's import
contracts).
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help). The module exposes `main(argv: list[str]) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("shoal.engine.entrypoints.serve",
              "Serve a model over an OpenAI-compatible HTTP API."),
    "router": ("shoal.router.main", "Route one InferenceEngine's requests to its engine groups."),
    "gateway": ("shoal.router.gateway",
                "Route by model across every InferenceEngine (fleet gateway)."),
    "fetch": ("shoal.fetch.cli",
              "Download a hub model (hf://ORG/NAME[@REV]) into a Hugging Face cache, once."),
    "make-model": ("shoal.engine.model_maker",
                   "Write the project's small Llama model to a directory."),
}


def _usage() -> str:
    lines = ["usage: shoal <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `shoal <command> --help` for the options of one command."]
    return "\n".join(lines)


def frontend_only_alias(rest: list[str]) -> list[str]:
    """`shoal serve [MODEL] --frontend-only ...` (releases before 0.2, and manifests written for
    them) as `shoal router` arguments: MODEL becomes `--model MODEL`."""
    rest = [a for a in rest if a != "--frontend-only"]
    if rest and not rest[0].startswith("-"):
        rest = ["--model", rest[0], *rest[1:]]
    return rest


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "serve" and "--frontend-only" in rest:
        name, rest = "router", frontend_only_alias(rest)
    if name not in SUBCOMMANDS:
        print(f"shoal: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
