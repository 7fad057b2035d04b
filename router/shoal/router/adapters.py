"""LoRA adapters in the routers: which group has which adapter loaded, read from each engine's
own `/v1/models` (an entry whose `parent` is set is an adapter, as vLLM lists them) by the
health prober after a good /health, and which adapters a group runs now (the newest series of
vLLM's `vllm:lora_requests_info`, its `running_lora_adapters` label: on the device).

A request whose `model` is an adapter goes only to the groups that list it, to those running
it when one of them is within the load bound of the least loaded (its weights are on the
device; another group would load them first); when no group lists it, the router answers
OpenAI's 404 naming the models there are, never a group that would 404 or, worse, answer with
the base model. Only while no group's list could be read (a read is tried first) does a
request pass on unchanged (the engine answers for its own names).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping

from shoal.contract.lora import listed  # noqa: F401 - the routers read it from here
from shoal.contract.routing import DEFAULT_IMBALANCE

INFO_METRIC = "vllm:lora_requests_info"  # the series `running` reads (health.py asks for it)
_INFO = re.compile(rf'^{re.escape(INFO_METRIC)}\{{([^}}]*)\}}\s+(\S+)', re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def running(metrics_text: str) -> frozenset[str]:
    """The adapters of the newest `vllm:lora_requests_info` series (its value is the time it was
    set); empty when the engine exports none."""
    newest, names = float("-inf"), ""
    for labels, value in _INFO.findall(metrics_text):
        try:
            at = float(value)
        except ValueError:
            continue
        if at >= newest:
            newest = at
            names = dict(_LABEL.findall(labels)).get("running_lora_adapters", "")
    return frozenset(n for n in names.split(",") if n)


def model_of(body: bytes) -> str | None:
    """The request body's `model`, None when absent or the body is not a JSON object."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


def read_any(states: Iterable) -> bool:
    """Whether any group's /v1/models was read: from then on a name that is neither served nor
    listed by a group is the router's 404, never a group's (found by benchmarks/lora_churn.py:
    an adapter just created, loaded nowhere yet, went to groups that answered 404)."""
    return any(s.adapters is not None for s in states)


SERVED, ADAPTER, UNKNOWN, UNREAD = "served", "adapter", "unknown", "unread"


async def lookup(model: str | None, served: Collection[str], states: Collection,
                 reread: Callable[[], Awaitable[None]]) -> str:
    """What a request's `model` is: SERVED (a base model's name, or none given), ADAPTER (a
    group lists it), UNKNOWN (no group lists it: the router's own 404), UNREAD (no group's list
    could be read: the request passes on). A name no list has is looked up again after
    `reread()` (lists read after the request came: an adapter loaded since, a group that just
    came back; found by benchmarks/lora_churn.py: a restarted group, its list not read yet,
    answered 404 for an adapter loaded nowhere yet)."""
    if model is None or model in served:
        return SERVED
    if model not in known(states):
        await reread()
    if model in known(states):
        return ADAPTER
    return UNKNOWN if read_any(states) else UNREAD


def known(states: Iterable) -> dict[str, str]:
    """Every adapter any group lists -> its parent."""
    out: dict[str, str] = {}
    for s in states:
        out.update(s.adapters or {})
    return out


def groups_for(name: str, states: Iterable, imbalance: int = DEFAULT_IMBALANCE,
               ) -> set[tuple[str, int]]:
    """The picker keys that may serve adapter `name`: the groups listing it, narrowed to those
    running it if one of them has at most `imbalance` requests more than the least loaded of
    the groups listing it. Empty when no group lists it."""
    having = [s for s in states if name in (s.adapters or {})]
    if not having:
        return set()
    least = min(s.outstanding for s in having)
    warm = [s for s in having if name in s.resident and s.outstanding <= least + imbalance]
    return {s.group.key for s in (warm or having)}


def model_cards(bases: Mapping[str, str], adapters: Mapping[str, str]) -> list[tuple]:
    """/v1/models rows (id, root, parent): the base models, then each adapter under its
    parent."""
    return ([(name, root, None) for name, root in bases.items()]
            + [(name, name, parent) for name, parent in sorted(adapters.items())])
