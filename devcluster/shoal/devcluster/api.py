"""The little HTTP the dev cluster speaks itself (stdlib): health endpoints and JSON lists.

Why not a Kubernetes client: this package runs from a bare python3 as root, and its callers
need only readiness and a few lists (nodes, Services, pods).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path


def ssl_context(ca_file: Path | None) -> ssl.SSLContext:
    """Verifying against `ca_file`, or not verifying at all (a component's self-signed
    /healthz on loopback)."""
    if ca_file is not None:
        return ssl.create_default_context(cafile=str(ca_file))
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _request(url: str, token: str | None) -> urllib.request.Request:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    return req


def https_ok(url: str, token: str | None = None, ca_file: Path | None = None) -> bool:
    try:
        with urllib.request.urlopen(_request(url, token), timeout=2,
                                    context=ssl_context(ca_file)) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def etcd_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return json.load(r).get("health") == "true"
    except (urllib.error.URLError, OSError, ValueError):
        return False


def get_json(server: str, path: str, token: str, ca_file: Path, timeout: float = 10) -> dict:
    with urllib.request.urlopen(_request(server + path, token), timeout=timeout,
                                context=ssl_context(ca_file)) as r:
        return json.load(r)
