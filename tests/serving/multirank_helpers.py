"""Helpers for the multi-rank serving tests: groups of real `shoal serve` processes on loopback
(one node, or two "nodes" that are two process trees joined over TCP), the transformers oracle
they are compared with, streams under load, and the process tree a kill must leave empty."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch
from support.net import free_port
from support.servers import MODEL_NAME, ServeProcess
from support.wait import wait_for

TIE_TOLERANCE = 1e-4  # as the oracle's: a mismatch is accepted only at a near-tie of the top-2
NUM_PROMPTS = 16
MAX_TOKENS = 16


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    lengths = [3, 7, 15, 16, 17, 24, 31, 33, 40, 48, 60, 64, 65, 70, 90, 100][:NUM_PROMPTS]
    return [torch.randint(5, 8192, (n,), generator=gen).tolist() for n in lengths]


class Oracle:
    """transformers' greedy generate in float32: the reference for every rank layout."""

    def __init__(self, model: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    @torch.inference_mode()
    def greedy(self, prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                  pad_token_id=0)
        return out[0, len(prompt):].tolist()

    @torch.inference_mode()
    def top2_gap(self, tokens: list[int]) -> float:
        logits = self.model(torch.tensor([tokens])).logits[0, -1]
        top = torch.topk(logits.float(), 2).values
        return float(top[0] - top[1])

    def check(self, prompts_: list[list[int]], outputs: list[list[int]]) -> list[str]:
        """Assert outputs equal greedy generate, or diverge only at a near-tie; return the ties."""
        ties = []
        for i, (p, got) in enumerate(zip(prompts_, outputs, strict=True)):
            ref = self.greedy(p)
            if got == ref:
                continue
            pos = next(k for k, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b)
            gap = self.top2_gap(p + ref[:pos])
            assert gap < TIE_TOLERANCE, (f"prompt {i}: token {pos} is {got[pos]}, transformers "
                                         f"{ref[pos]}, top-2 gap {gap:.3g} is not a near-tie")
            ties.append(f"prompt {i}: near-tie at token {pos}")
        return ties


def complete_all(server: ServeProcess, prompts_: list[list[int]]) -> list[list[int]]:
    """Every prompt at once (one request each, concurrently), greedy; the token ids back."""
    results: list = [None] * len(prompts_)

    def one(i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": prompts_[i], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        results[i] = r

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts_))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = []
    for r in results:
        assert r.status_code == 200, r.text
        out.append(_token_ids(server, r.json()["choices"][0]))
    return out


def _token_ids(server: ServeProcess, choice: dict) -> list[int]:
    if choice.get("token_ids") is not None:
        return list(choice["token_ids"])
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "prompt": choice["text"],
                                                    "add_special_tokens": False}, timeout=30)
    raise AssertionError(f"the server returned no token ids; text round trip: {r.text[:200]}")


class Streams:
    """N concurrent streaming completions, long enough to be in flight when a rank is killed."""

    def __init__(self, server: ServeProcess, n: int, max_tokens: int = 1500) -> None:
        self.events: list[list[str]] = [[] for _ in range(n)]
        self.started = [threading.Event() for _ in range(n)]  # first event seen (or ended)
        self.ended_at: list[float | None] = [None] * n
        body = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        self.threads = [threading.Thread(target=self._run, args=(server, body, i), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, server: ServeProcess, body: dict, i: int) -> None:
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                              timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events[i].append(line[6:])
                        self.started[i].set()
        except httpx.HTTPError as exc:
            self.events[i].append(f"transport error: {exc}")
        finally:
            self.ended_at[i] = time.monotonic()
            self.started[i].set()

    def wait_started(self, timeout: float = 300) -> None:
        """Every stream has its first event (so all are in flight), or the test fails."""
        deadline = time.monotonic() + timeout
        for ev in self.started:
            assert ev.wait(max(0.0, deadline - time.monotonic())), "a stream never started"
        assert all(e and not e[-1].startswith("transport") for e in self.events), self.events

    def join(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "streams still open"

    def errors(self) -> list[str]:
        """Each stream's error message; asserts every stream ended with an error then [DONE]."""
        out = []
        for ev in self.events:
            assert ev and ev[-1] == "[DONE]", ev[-3:]
            err = json.loads(ev[-2]).get("error")
            assert err is not None, ev[-3:]
            out.append(err["message"])
        return out

    def finish_reasons(self) -> list[str | None]:
        out = []
        for ev in self.events:
            assert ev and ev[-1] == "[DONE]", ev[-3:]
            chunks = [json.loads(e) for e in ev[:-1]]
            assert not any("error" in c for c in chunks), ev[-3:]
            out.append(chunks[-1]["choices"][0]["finish_reason"])
        return out


def process_tree(*servers: ServeProcess) -> list[psutil.Process]:
    procs = []
    for s in servers:
        root = psutil.Process(s.proc.pid)
        procs += [root, *root.children(recursive=True)]
    return procs


def assert_tree_gone(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    """Every process of the tree has exited within `timeout` (orphans included)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {[(p.pid, p.cmdline()[:4]) for p in alive]}"


def child_with(server: ServeProcess, marker: str) -> psutil.Process:
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    found = [k for k in kids if marker in " ".join(k.cmdline())]
    assert found, f"no child process with {marker!r}"
    return found[0]


def termination(server: ServeProcess) -> dict:
    return json.loads(Path(server.termination_log).read_text())


def two_node_flags(tp: int) -> tuple[list[str], list[str]]:
    """Flags of node 0 and of the headless node 1 of a two-node group on loopback."""
    common = ["--dtype", "float32", "--tensor-parallel-size", str(tp), "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(_port_pair())]
    return [*common, "--node-rank", "0"], [*common, "--node-rank", "1", "--headless"]


def _port_pair() -> int:
    """A free port whose successor (the group link) is free too."""
    for _ in range(50):
        port = free_port()
        try:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise AssertionError("no two adjacent free ports")


__all__ = ["Oracle", "Streams", "assert_tree_gone", "child_with", "complete_all", "prompts",
           "process_tree", "termination", "two_node_flags", "wait_for"]
