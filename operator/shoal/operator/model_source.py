"""Where `spec.model` comes from, read once: a path or name the engine resolves itself (the form
that has always been valid), or `pvc://CLAIM/PATH`, a PersistentVolumeClaim the operator mounts
read-only at PVC_MOUNT_DIR, the engine started on PVC_MOUNT_DIR/PATH.

Any other `scheme://` (`hf://`, `oci://`: issue 23, not implemented yet) is refused, never
served as a path: MODEL_PATTERN is the CRD schema's `pattern` (the API server refuses it at
apply) and `problems` says the same as SpecValid=False for a body the schema did not check.
The pattern is RE2 (Go's regexp, what the API server runs): no look-ahead, hence its shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PVC_SCHEME = "pvc"
PVC_MOUNT_DIR = "/mnt/models"  # where a pvc:// claim appears in every engine container
NOT_YET = ("hf", "oci")  # schemes users write (KServe, KubeAI) that Shoal does not fetch yet

# A claim is a DNS-1123 subdomain (a PVC's name); PATH is one or more segments, none empty,
# `.` or `..` (the engine must stay inside the claim).
_CLAIM = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
_SEGMENT = r"([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+)"
PVC_PATTERN = rf"pvc://{_CLAIM}/{_SEGMENT}(/{_SEGMENT})*"
# No `://` after a run of scheme characters: a path (`/models/x`) or a name (`org/name`).
_SCHEME_CHARS = r"A-Za-z0-9+.\-"
PLAIN_PATTERN = rf"[{_SCHEME_CHARS}]*([^{_SCHEME_CHARS}:].*|:([^/].*|/([^/].*)?)?)?"
MODEL_PATTERN = rf"^({PVC_PATTERN}|{PLAIN_PATTERN})$"
_SCHEME = re.compile(rf"^([{_SCHEME_CHARS}]*)://")


@dataclass(frozen=True)
class ModelSource:
    """`scheme` is "" for a path or name; `arg` is what the engine is started on."""

    scheme: str
    arg: str
    claim: str = ""  # pvc:// only

    @property
    def is_pvc(self) -> bool:
        return self.scheme == PVC_SCHEME


def parse(model: str) -> ModelSource:
    """Total: a reference `problems` refuses still parses (its `arg` is never run)."""
    found = _SCHEME.match(model)
    if not found:
        return ModelSource("", model)
    scheme, rest = found.group(1), model[found.end():]
    if scheme != PVC_SCHEME:
        return ModelSource(scheme, model)
    claim, _, path = rest.partition("/")
    return ModelSource(PVC_SCHEME, f"{PVC_MOUNT_DIR}/{path}", claim)


def problems(model: str) -> list[str]:
    """Why `spec.model` cannot be served, each saying what to write instead; [] when valid."""
    source = parse(model)
    if source.scheme in NOT_YET:
        return [f"spec.model {model!r}: {source.scheme}:// is not implemented yet; put the "
                "model on a volume and use pvc://CLAIM/PATH, or a path under "
                "spec.modelVolume.mountPath"]
    if not re.fullmatch(MODEL_PATTERN, model):
        if source.is_pvc:
            return [f"spec.model {model!r} is malformed: pvc://CLAIM/PATH needs a claim name "
                    "(lowercase DNS name) and a path inside it without empty, . or .. segments"]
        return [f"spec.model {model!r}: unknown scheme {source.scheme}://; the forms are "
                "pvc://CLAIM/PATH, a path inside the engine container, or a model name"]
    return []
