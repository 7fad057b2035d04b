"""`python3 shoal-supervisor.pyz [--termination-log PATH] -- CMD ...` (shoal.contract.supervisor).

Exit codes: asked to stop (SIGTERM/SIGINT), vLLM's own; otherwise never 0 (vLLM's code, 128+N
for signal N, 1 for an unasked exit 0); 2 for a bad command line, 127 when CMD cannot start.
"""

from __future__ import annotations

import os
import sys

from shoal.contract import env, supervisor
from shoal.contract.termination import DEFAULT_PATH

USAGE = "usage: shoal-supervisor [--termination-log PATH] -- CMD [ARG ...]"


class UsageError(ValueError):
    pass


def parse_args(args: list[str], environ: dict) -> tuple[str, list[str]]:
    """(termination log path, the command) from our argv; UsageError names what is wrong."""
    path = environ.get(env.TERMINATION_LOG) or DEFAULT_PATH
    if supervisor.SEPARATOR not in args:
        raise UsageError(f"no {supervisor.SEPARATOR!r} before the command")
    sep = args.index(supervisor.SEPARATOR)
    own, command = args[:sep], args[sep + 1:]
    while own:
        opt = own.pop(0)
        if opt == "--termination-log":
            if not own:
                raise UsageError("--termination-log needs a path")
            path = own.pop(0)
        elif opt.startswith("--termination-log="):
            path = opt.partition("=")[2]
        else:
            raise UsageError(f"unknown option {opt!r}")
    if not command:
        raise UsageError("no command after --")
    return path, command


def main() -> int:
    try:
        path, command = parse_args(sys.argv[1:], dict(os.environ))
    except UsageError as exc:
        print(f"shoal-supervisor: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    from shoal.supervisor.supervise import run

    return run(command, path)


if __name__ == "__main__":
    sys.exit(main())
