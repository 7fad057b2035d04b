"""Routing policy names (`spec.frontend.routing`, `shoal gateway --routing`) and the environment
through which the operator tells a per-engine frontend which one to run."""

from __future__ import annotations

LEAST_OUTSTANDING = "least-outstanding"
PREFIX_AFFINITY = "prefix-affinity"
ROUTINGS = (LEAST_OUTSTANDING, PREFIX_AFFINITY)
DEFAULT_ROUTING = LEAST_OUTSTANDING

ROUTING_ENV = "SHOAL_ROUTER_ROUTING"  # one of ROUTINGS
IMBALANCE_ENV = "SHOAL_ROUTER_PREFIX_IMBALANCE"  # prefix-affinity's load bound, a whole number
DEFAULT_IMBALANCE = 4
