"""The discovery document: which engine groups are ready to serve, written by the operator and
read by every router.

The operator keeps it in ConfigMap `NAME-engines` under key `KEY`, mounted into each frontend at
`MOUNT_DIR` and watched through the API when `CONFIGMAP_ENV` and `NAMESPACE_ENV` are set::

    {"groups": [{"group": 0, "url": "http://NAME-g0-r0.NAME-ranks.NS.svc:8000"}],
     "model": "served-name"}

Only groups whose every rank is Ready and that are not draining are listed. `encode` and
`decode` are the only writer and reader of the format.

`"wakeable": true` (appended; absent means false) says the engine may have no group on purpose
(spec.autoscaling.minReplicas 0): a router then holds a request that finds no group, for a
while, and asks for a group by renewing the Lease `wake_lease_name(NAME)` (its
spec.renewTime: the request's time), which the operator creates with the engine, lets the
engine's frontends patch, and reads while the engine has no group.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

KEY = "engines.json"  # the ConfigMap key, and the file's name in the mounted volume
MOUNT_DIR = "/etc/shoal/discovery"
CONFIGMAP_ENV = "SHOAL_DISCOVERY_CONFIGMAP"  # the ConfigMap's name, set on frontend pods
NAMESPACE_ENV = "POD_NAMESPACE"  # the frontend pod's namespace (downward API)
POD_ENV = "POD_NAME"  # the frontend pod's name (downward API): the wake Lease's holderIdentity


def configmap_name(engine: str) -> str:
    """The discovery ConfigMap of InferenceEngine `engine`."""
    return f"{engine}-engines"


def wake_lease_name(engine: str) -> str:
    """The Lease a router renews to wake InferenceEngine `engine` from zero groups."""
    return f"{engine}-wake"


def engine_of_configmap(name: str) -> str:
    """The InferenceEngine whose discovery ConfigMap is `name` (configmap_name's inverse)."""
    return name.removesuffix("-engines")


def encode(model: str | None, groups: dict[int, str], wakeable: bool = False) -> str:
    """The document for `groups` (group index -> rank 0's base URL) serving `model`."""
    doc = {"model": model, "groups": [{"group": g, "url": groups[g]} for g in sorted(groups)]}
    if wakeable:
        doc["wakeable"] = True
    return json.dumps(doc, sort_keys=True)


def decode_wakeable(text: str) -> bool:
    """The document's `wakeable` (False when absent or the document is not an object)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(data, dict) and data.get("wakeable") is True


def decode(text: str) -> tuple[str | None, dict[int, str]]:
    """(model, {group: url}) from a document; ValueError says what is wrong and where."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("the top level must be an object with a 'groups' list")
    raw = data.get("groups")
    if not isinstance(raw, list):
        raise ValueError("'groups' must be a list of {\"group\": N, \"url\": \"http://...\"}")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("'model' must be a string")
    groups: dict[int, str] = {}
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ValueError(f"groups[{i}] must be an object, got {type(item).__name__}")
        gid, url = item.get("group"), item.get("url")
        if not isinstance(gid, int) or isinstance(gid, bool) or gid < 0:
            raise ValueError(f"groups[{i}].group must be a non-negative integer, got {gid!r}")
        if not isinstance(url, str):
            raise ValueError(f"groups[{i}].url must be a string, got {url!r}")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"groups[{i}].url must be http(s)://HOST[:PORT], got {url!r}")
        if gid in groups:
            raise ValueError(f"group {gid} is listed twice")
        groups[gid] = url.rstrip("/")
    return model, groups
