"""What `spec.frontend.routing: kv-aware` adds to the pods (docs/router.md, "kv-aware").

- Rank 0 of every group publishes its KV events: vLLM's `--kv-events-config` (ZMQ PUB on
  EVENTS_PORT, replay on REPLAY_PORT; the same flag for Shoal's engine and a stock vLLM) and
  the two container ports. The routers find a group's events at its rank 0's address in
  discovery (`NAME-gG-r0.NAME-ranks.NS.svc`) with these ports.
- Every frontend pod carries the model's tokenizer, because the routers tokenize a prompt to
  look its blocks up: an hf:// model's tokenizer files (`shoal fetch --files tokenizer`, no
  weights) into the pod's own emptyDir cache; an oci://, pvc:// or spec.modelVolume model's
  volume, mounted read-only as the engines mount it.

Pure builders, table-tested (tests/operator/test_op_kv_parts.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from shoal.contract import model_fetch as mf
from shoal.contract import routing
from shoal.operator.model_volumes import fetch_container, model_parts
from shoal.operator.spec import EngineSpec

EVENTS_PORT = routing.DEFAULT_KV_EVENTS_PORT
REPLAY_PORT = routing.DEFAULT_KV_REPLAY_PORT
# Engine flags that would make the routers' index wrong, and why (refused with kv-aware).
REFUSED_ENGINE_FLAGS = {
    "--kv-events-config": "the operator sets it for kv-aware routing (its ports are the "
                          "routers' contract)",
    "--tokenizer": "the frontends tokenize with the model's own tokenizer; another one in the "
                   "engines would make every lookup miss",
    "--no-enable-prefix-caching": "without a prefix cache the engines publish no KV events",
}


def enabled(spec: EngineSpec) -> bool:
    return spec.frontend_routing == routing.KV_AWARE


def events_config() -> str:
    """vLLM's KVEventsConfig as JSON: publish on every interface, replay beside it."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{EVENTS_PORT}",
                       "replay_endpoint": f"tcp://*:{REPLAY_PORT}"}, separators=(",", ":"))


def engine_args(spec: EngineSpec, rank: int) -> list[str]:
    return ["--kv-events-config", events_config()] if enabled(spec) and rank == 0 else []


def engine_ports(spec: EngineSpec, rank: int) -> list[dict]:
    if not (enabled(spec) and rank == 0):
        return []
    return [{"name": "kv-events", "containerPort": EVENTS_PORT, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": REPLAY_PORT, "protocol": "TCP"}]


@dataclass(frozen=True)
class FrontendParts:
    """What kv-aware adds to a frontend pod."""

    volumes: list[dict] = field(default_factory=list)
    init_containers: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)  # the frontend container's
    env: list[dict] = field(default_factory=list)  # the frontend container's


def tokenizer_source(spec: EngineSpec) -> str | None:
    """How a frontend reads the tokenizer: `hf://` (fetched), `volume` (the model's own volume
    mounted); None when the model is only inside the engine image (kv-aware is refused)."""
    if spec.source.is_hf:
        return "hf://"
    if spec.source.is_oci or spec.source.is_pvc or spec.model_volume:
        return "volume"
    return None


def frontend_parts(spec: EngineSpec) -> FrontendParts:
    if not enabled(spec):
        return FrontendParts()
    env = [{"name": routing.KV_EVENTS_PORT_ENV, "value": str(EVENTS_PORT)},
           {"name": routing.KV_REPLAY_PORT_ENV, "value": str(REPLAY_PORT)}]
    how = tokenizer_source(spec)
    if how == "hf://":
        hub = spec.source.hub
        assert hub is not None
        fetch = fetch_container(spec, files="tokenizer")
        # Its own emptyDir even when spec.modelCache is shared: a few MB, and a tokenizer-only
        # snapshot never sits beside the engines' records.
        return FrontendParts(
            volumes=[{"name": mf.CACHE_VOLUME, "emptyDir": {}}], init_containers=[fetch],
            mounts=[{"name": mf.CACHE_VOLUME, "mountPath": mf.CACHE_MOUNT, "readOnly": True}],
            env=env + [{"name": "HF_HUB_CACHE", "value": mf.CACHE_DIR},
                       {"name": routing.KV_TOKENIZER_ENV, "value": hub.uri}])
    if how == "volume":
        model = model_parts(spec)
        return FrontendParts(volumes=model.volumes, init_containers=model.init_containers,
                             mounts=model.mounts,
                             env=env + [{"name": routing.KV_TOKENIZER_ENV, "value": model.arg}])
    return FrontendParts(env=env)  # refused by problems()


def _flag_given(args, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def problems(spec: EngineSpec) -> list[str]:
    """Why kv-aware cannot be rendered for this spec, each saying what to change."""
    if not enabled(spec):
        return []
    out = []
    if tokenizer_source(spec) is None:
        out.append(f"spec.frontend.routing: kv-aware needs the model's tokenizer in the "
                   f"frontends, which cannot read {spec.model!r} inside the engine image: use "
                   "an hf://, oci:// or pvc:// model or spec.modelVolume")
    for flag, why in REFUSED_ENGINE_FLAGS.items():
        if _flag_given(spec.extra_args, flag):
            out.append(f"spec.engine.extraArgs: {flag} cannot be used with "
                       f"spec.frontend.routing: kv-aware: {why}")
    return out
