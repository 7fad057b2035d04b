"""Container HEALTHCHECK shared by Shoal's images: probe only what the running command serves.

Reads the command line of PID 1 (tini and the command it runs) and decides:
- `shoal-operator ... --liveness=URL`: GET that URL (kopf's liveness endpoint).
- `shoal serve ...` (an engine with its API server), `shoal router ...` or `shoal gateway ...`:
  GET /health on --port (8000).
- `shoal serve ... --headless`, or any other command: nothing listens, so there is nothing to
  probe; exit 0 (Docker already knows whether the process lives).

Kubernetes ignores HEALTHCHECK; the chart and the operator set their own probes. Standard
library only, so it runs in every image.
"""

from __future__ import annotations

import sys
import urllib.request


def _argv(pid: int = 1) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def probe_url(argv: list[str]) -> str | None:
    """The URL to probe for this command line, or None when nothing serves HTTP."""
    if any(a.endswith("shoal-operator") for a in argv):
        url = _option(argv, "--liveness") or _option(argv, "-L")
        return url.replace("0.0.0.0", "127.0.0.1") if url else None
    if any(cmd in argv for cmd in ("serve", "router", "gateway")) and "--headless" not in argv:
        return f"http://127.0.0.1:{_option(argv, '--port') or '8000'}/health"
    return None


def main() -> int:
    url = probe_url(_argv())
    if url is None:
        return 0
    try:
        with urllib.request.urlopen(url, timeout=4) as resp:
            ok = 200 <= resp.status < 300
            print(f"{url}: HTTP {resp.status}")
            return 0 if ok else 1
    except Exception as e:  # noqa: BLE001 - any failure is "unhealthy", with the reason
        print(f"{url}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
