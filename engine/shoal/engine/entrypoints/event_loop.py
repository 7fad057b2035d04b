"""The event loop of the HTTP processes (`shoal serve` and `--frontend-only`).

uvloop where installed (the engine extra installs it, as vLLM's `uvicorn[standard]` does): most of
a frontend's per-token cost is event-loop and socket work, and on a 2-core machine that CPU is
taken from the engine. httptools, the other half of that extra, uvicorn picks up by itself.
"""

from __future__ import annotations

import asyncio


def run(coro):
    """Run `coro` to completion on a fresh loop, like `asyncio.run`."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
