"""`shoal fetch hf://ORG/NAME[@REVISION] --cache-dir DIR`: the hf:// init container's command.

Exit 0: the snapshot is in DIR (downloaded or already there). Exit 2: a permanent fault (not
found, access denied, bad reference), exit 1: a transient one (network, hub, hash mismatch); both
write the termination message (shoal.contract.termination) naming the repository. Stdout carries
one line per event and progress lines (shoal.contract.model_fetch.progress_line), each flushed.
"""

from __future__ import annotations

import argparse
import os
import sys

from shoal.contract.model_fetch import ENDPOINT_ENV, FILE_SETS, TOKEN_ENV, HubRef, parse_hf
from shoal.contract.termination import Cause, write_termination_message
from shoal.fetch.errors import PERMANENT_EXIT, Context, classify, scrub


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shoal fetch",
        description="Download a hub model's engine files into a Hugging Face cache, once "
                    f"(token from ${TOKEN_ENV}, hub from ${ENDPOINT_ENV}).")
    p.add_argument("model", help="hf://ORG/NAME[@REVISION] (revision default: main)")
    p.add_argument("--cache-dir", default=None,
                   help="the cache (huggingface_hub's layout; default: huggingface_hub's own, "
                        "HF_HUB_CACHE or HF_HOME/hub)")
    p.add_argument("--files", choices=sorted(FILE_SETS), default="engine",
                   help="engine: what `serve` loads (weights too); tokenizer: what a router "
                        "needs to tokenize as the engine does (no weights)")
    p.add_argument("--max-workers", type=int, default=8,
                   help="files downloaded at once (snapshot_download's max_workers)")
    return p


def emit(line: str) -> None:
    print(line, flush=True)


def _fail(cause: Cause, message: str, code: int) -> int:
    emit(f"fetch failed ({cause.value}): {message}")
    write_termination_message(cause, message, exit_code=code)
    return code


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        ref: HubRef = parse_hf(args.model)
    except ValueError as exc:
        return _fail(Cause.CONFIG_ERROR, str(exc), PERMANENT_EXIT)
    # The client's own bars are one line per update on a pod log: ours replace them.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from huggingface_hub import constants, get_token
    from shoal.fetch.download import fetch

    token = os.environ.get(TOKEN_ENV) or None
    cache_dir = args.cache_dir or constants.HF_HUB_CACHE
    ctx = Context(ref, constants.ENDPOINT, (token or get_token()) is not None)
    try:
        fetch(ref, cache_dir, token=token, emit=emit, max_workers=args.max_workers,
              patterns=FILE_SETS[args.files])
    except Exception as exc:  # noqa: BLE001 - every failure is classified and named
        failure = classify(exc, ctx)
        return _fail(failure.cause, scrub(failure.message, token), failure.exit_code)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
