"""Routing policy names (`spec.frontend.routing`, `shoal gateway --routing`) and the environment
through which the operator tells a per-engine frontend which one to run."""

from __future__ import annotations

LEAST_OUTSTANDING = "least-outstanding"
PREFIX_AFFINITY = "prefix-affinity"
KV_AWARE = "kv-aware"  # by the engines' KV events (vLLM's format): router/shoal/router/kv_score.py
ROUTINGS = (LEAST_OUTSTANDING, PREFIX_AFFINITY, KV_AWARE)
DEFAULT_ROUTING = LEAST_OUTSTANDING

ROUTING_ENV = "SHOAL_ROUTER_ROUTING"  # one of ROUTINGS
IMBALANCE_ENV = "SHOAL_ROUTER_PREFIX_IMBALANCE"  # prefix-affinity's load bound, a whole number
DEFAULT_IMBALANCE = 4

# kv-aware: the engines' KV event ports (vLLM's --kv-events-config endpoint / replay_endpoint)
# on each group's rank-0 host, and the model's tokenizer.json (a file or its folder).
KV_EVENTS_PORT_ENV = "SHOAL_ROUTER_KV_EVENTS_PORT"
KV_REPLAY_PORT_ENV = "SHOAL_ROUTER_KV_REPLAY_PORT"
KV_TOKENIZER_ENV = "SHOAL_ROUTER_KV_TOKENIZER"
DEFAULT_KV_EVENTS_PORT = 5557  # vLLM's default endpoint tcp://*:5557
DEFAULT_KV_REPLAY_PORT = 5558
