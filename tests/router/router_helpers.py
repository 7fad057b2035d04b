"""Helpers for router tests: a real `shoal serve --frontend-only` subprocess routing to real
`shoal serve` engine servers (started with the serving tests' `ServeProcess`)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import httpx
from support.net import free_port
from support.servers import API_KEY, MODEL_NAME, ServeProcess, ServerProcess

__all__ = ["API_KEY", "MODEL_NAME", "GatewayProcess", "RouterProcess", "ServeProcess",
           "local_discovery", "write_atomically", "write_discovery"]


def write_discovery(path: Path, engines: dict[int, ServeProcess], model: str = MODEL_NAME):
    """Replace the file atomically, as the kubelet does for a ConfigMap volume."""
    groups = [{"group": g, "url": e.url} for g, e in sorted(engines.items())]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"groups": groups, "model": model}))
    os.replace(tmp, path)


class RouterProcess(ServerProcess):
    """`shoal router` routing to the groups listed in a discovery file."""

    def __init__(self, model: str, discovery: Path, tmp: Path, *flags: str,
                 api_key: str | None = API_KEY, env: dict | None = None) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "shoal.cli", "router", "--model", model,
                "--engine-discovery-file", str(discovery), "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", MODEL_NAME, *flags]
        if api_key:
            args += ["--api-key", api_key]
        # Fast polling keeps the tests short; production defaults are 1 s / 2 s / 5 s.
        full = {**os.environ, "SHOAL_ROUTER_POLL_S": "0.1", "SHOAL_ROUTER_PROBE_S": "0.3",
                "SHOAL_ROUTER_COOLDOWN_S": "1", **(env or {})}
        super().__init__(args, tmp / f"router-{self.port}.log", full, api_key)

    def wait_listening(self, timeout: float = 30.0) -> RouterProcess:
        return self.wait_answering("/version", "the router to listen", timeout)

    def metrics(self) -> dict[str, float]:
        """Every sample of the router's /metrics as {'name{labels}': value}."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def per_group(self, outcome: str = "ok") -> dict[str, float]:
        """Forwarded requests per group id with this outcome, summed over endpoints."""
        counts: dict[str, float] = {}
        for key, value in self.metrics().items():
            if key.startswith("shoal_router_requests_total{") and f'outcome="{outcome}"' in key:
                gid = key.split('group="', 1)[1].split('"', 1)[0]
                counts[gid] = counts.get(gid, 0) + value
        return counts


def engine_successes(engine: ServeProcess) -> float:
    """Finished requests the engine itself counted (its own `vllm:request_success`)."""
    text = httpx.get(f"{engine.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def kill_group(engine: ServeProcess) -> None:
    """SIGKILL the whole `shoal serve` process group (API server and EngineCore)."""
    os.killpg(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait(10)


class GatewayProcess(ServerProcess):
    """`python -m shoal.router.gateway` over a discovery directory and/or the API."""

    def __init__(self, tmp: Path, *flags: str, api_key: str | None = API_KEY,
                 env: dict | None = None) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "shoal.router.gateway", "--host", "127.0.0.1",
                "--port", str(self.port), *flags]
        if api_key:
            args += ["--api-key", api_key]
        # Fast polling keeps the tests short; production defaults are 1 s / 2 s / 5 s.
        full = {**os.environ, "SHOAL_ROUTER_POLL_S": "0.1", "SHOAL_ROUTER_PROBE_S": "0.3",
                "SHOAL_ROUTER_COOLDOWN_S": "1", **(env or {})}
        super().__init__(args, tmp / f"gateway-{self.port}.log", full, api_key)

    def wait_listening(self, timeout: float = 30.0) -> GatewayProcess:
        return self.wait_answering("/version", "the gateway to listen", timeout)

    metrics = RouterProcess.metrics
    per_group = RouterProcess.per_group


def local_discovery(rendered: str, engines: dict[int, ServeProcess]) -> str:
    """`render`'s engines.json with each group's rank-0 address resolved to the local engine
    that plays it: the test's stand-in for cluster DNS. Everything else is render's own."""
    data = json.loads(rendered)
    for g in data["groups"]:
        g["url"] = engines[g["group"]].url
    return json.dumps(data, sort_keys=True)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def prefix_cache(engine: ServeProcess) -> tuple[float, float]:
    """(hits, queries) in tokens, from the engine's own vllm:prefix_cache_* counters."""
    return (engine.metric("vllm:prefix_cache_hits_total"),
            engine.metric("vllm:prefix_cache_queries_total"))


def chat_with_system(url: str, headers: dict, model: str, system: str, question: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=60,
                   json={"model": model, "max_tokens": 2, "messages": [
                       {"role": "system", "content": system},
                       {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
