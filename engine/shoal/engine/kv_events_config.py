"""`--kv-events-config`: vLLM 0.32's KVEventsConfig (vllm/config/kv_events.py), read as vLLM does.

The same eight fields with the same defaults, and vLLM's one derived rule: an unset `publisher`
is "zmq" when events are enabled, else "null". Parsed like vLLM's pydantic model in its lax mode
(JSON true/false or "true"/"yes"/1 for the flag, integers also as strings); an unknown field or a
wrong type is refused naming the field, as vLLM refuses it. Shoal refuses further what it would
do wrongly: an `inproc://` endpoint (no consumer outside the engine process could reach it),
`tcp://*:0` (vLLM resolves it to the node's IP and a port it reports nowhere a router reads) and
negative sizes (vLLM would fail later, at the first event or not at all).
Standard library only: the frontend parses the flag before any engine code loads.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from shoal.engine.errors import ConfigError

PUBLISHERS = ("zmq", "null")  # vLLM's EventPublisherFactory registry


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None -> "zmq" when enabled, else "null" (vLLM's rule)
    endpoint: str = "tcp://*:5557"  # PUB: "*", "::", ipc:// bind; any other address connects
    replay_endpoint: str | None = None  # ROUTER (always bound): batches again from a seq number
    buffer_steps: int = 10_000  # batches (engine steps) kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (0: none)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread (0: unbounded)
    topic: str = ""  # the first frame of every message

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")

    @property
    def publishes(self) -> bool:
        """Whether the engine builds and sends events at all (vLLM's factory: otherwise the
        null publisher, and Shoal then builds nothing)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


_FIELDS = {f.name: f for f in dataclasses.fields(KVEventsConfig)}
# pydantic's lax booleans (what vLLM's KVEventsConfig accepts)
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def _fail(name: str, msg: str) -> None:
    raise ConfigError(f"--kv-events-config: {name} {msg}")


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    _fail(name, f"must be a boolean, got {value!r}")


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            _fail(name, f"must be an integer, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, f"must be an integer, got {value!r}")
    if value < 0:
        _fail(name, f"must not be negative, got {value}")
    return value


def _as_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        _fail(name, f"must be a string, got {value!r}")
    return value


def _check_endpoint(name: str, endpoint: str) -> None:
    if endpoint.startswith("inproc://"):
        _fail(name, f"{endpoint!r} is not supported: an inproc:// socket is reachable only "
                    "inside the engine process; use tcp://*:PORT or ipc://PATH")
    if not endpoint.startswith(("tcp://", "ipc://")):
        _fail(name, f"must be a ZeroMQ tcp:// or ipc:// address, got {endpoint!r}")
    if endpoint == "tcp://*:0":
        _fail(name, "tcp://*:0 is not supported: the port the system picks would be reported "
                    "to no consumer; name a port")


def parse_kv_events_config(value: str | dict | KVEventsConfig | None) -> KVEventsConfig | None:
    """A KVEventsConfig from the flag's JSON text, a dict (LLM(kv_events_config=...), the
    engine process's spec) or one already made; ConfigError naming the field otherwise."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--kv-events-config must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--kv-events-config must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"--kv-events-config: unknown field(s) {unknown}; vLLM 0.32's "
                          f"KVEventsConfig has {list(_FIELDS)}")
    kw: dict[str, Any] = {}
    for name, raw in value.items():
        if name == "enable_kv_cache_events":
            kw[name] = _as_bool(name, raw)
        elif name in ("buffer_steps", "hwm", "max_queue_size"):
            kw[name] = _as_int(name, raw)
        elif name in ("publisher", "replay_endpoint") and raw is None:
            kw[name] = None
        else:
            kw[name] = _as_str(name, raw)
    publisher = kw.get("publisher")
    if publisher is not None and publisher not in PUBLISHERS:
        _fail("publisher", f"must be 'zmq' or 'null' (vLLM's publishers), got {publisher!r}")
    config = KVEventsConfig(**kw)
    if config.publishes:
        _check_endpoint("endpoint", config.endpoint)
        if config.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", config.replay_endpoint)
            if config.replay_endpoint == config.endpoint:
                _fail("replay_endpoint", f"must differ from endpoint ({config.endpoint!r})")
    return config
