"""Where `spec.model` comes from, read once:
- a path or name the engine resolves itself (the form that has always been valid);
- `pvc://CLAIM/PATH`: a PersistentVolumeClaim the operator mounts read-only at PVC_MOUNT_DIR,
  the engine started on PVC_MOUNT_DIR/PATH;
- `hf://ORG/NAME[@REVISION]`: fetched from the hub by the `model-fetch` init container into the
  model cache (shoal.contract.model_fetch), the engine started on the repo id, offline;
- `oci://IMAGE[:TAG]`: the model as an OCI image (the model directory at OCI_MODEL_DIR in it),
  copied into the pod by an init container or mounted as an image volume at OCI_MOUNT_DIR.

Any other `scheme://` is refused, never served as a path: MODEL_PATTERN is the CRD schema's
`pattern` (the API server refuses it at apply) and `problems` says the same as SpecValid=False
for a body the schema did not check. The pattern is RE2 (Go's regexp, what the API server
runs): no look-ahead, hence its shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shoal.contract import model_fetch
from shoal.contract.model_fetch import HF_PATTERN, OCI_PATTERN, HubRef

PVC_SCHEME = "pvc"
HF_SCHEME = model_fetch.HF_SCHEME
OCI_SCHEME = model_fetch.OCI_SCHEME
PVC_MOUNT_DIR = "/mnt/models"  # where a pvc:// claim appears in every engine container
OCI_MOUNT_DIR = "/mnt/models"  # where an oci:// model appears (KServe's modelcar path too)
OCI_MODEL_DIR = "/models"  # where a model image holds the model (KServe modelcar's layout)
SCHEMES = (PVC_SCHEME, HF_SCHEME, OCI_SCHEME)

# A claim is a DNS-1123 subdomain (a PVC's name); PATH is one or more segments, none empty,
# `.` or `..` (the engine must stay inside the claim).
_CLAIM = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
_SEGMENT = r"([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+)"
PVC_PATTERN = rf"pvc://{_CLAIM}/{_SEGMENT}(/{_SEGMENT})*"
# No `://` after a run of scheme characters: a path (`/models/x`) or a name (`org/name`).
_SCHEME_CHARS = r"A-Za-z0-9+.\-"
PLAIN_PATTERN = rf"[{_SCHEME_CHARS}]*([^{_SCHEME_CHARS}:].*|:([^/].*|/([^/].*)?)?)?"
MODEL_PATTERN = rf"^({PVC_PATTERN}|{HF_PATTERN}|{OCI_PATTERN}|{PLAIN_PATTERN})$"
_SCHEME = re.compile(rf"^([{_SCHEME_CHARS}]*)://")
_FORMS = ("pvc://CLAIM/PATH, hf://ORG/NAME[@REVISION], oci://REGISTRY/REPO[:TAG|@DIGEST], a "
          "path inside the engine container, or a model name")


@dataclass(frozen=True)
class ModelSource:
    """`scheme` is "" for a path or name; `arg` is what the engine is started on."""

    scheme: str
    arg: str
    claim: str = ""  # pvc:// only
    hub: HubRef | None = None  # hf:// only
    image: str = ""  # oci:// only: the image reference without the scheme

    @property
    def is_pvc(self) -> bool:
        return self.scheme == PVC_SCHEME

    @property
    def is_hf(self) -> bool:
        return self.scheme == HF_SCHEME

    @property
    def is_oci(self) -> bool:
        return self.scheme == OCI_SCHEME

    @property
    def fetched(self) -> bool:
        """The operator brings the model into the pod (the pod's model volumes are its own)."""
        return self.scheme in SCHEMES


def parse(model: str) -> ModelSource:
    """Total: a reference `problems` refuses still parses (its `arg` is never run)."""
    found = _SCHEME.match(model)
    if not found:
        return ModelSource("", model)
    scheme, rest = found.group(1), model[found.end():]
    if scheme == PVC_SCHEME:
        claim, _, path = rest.partition("/")
        return ModelSource(PVC_SCHEME, f"{PVC_MOUNT_DIR}/{path}", claim)
    if scheme == HF_SCHEME:
        repo, _, rev = rest.partition("@")
        hub = HubRef(repo, rev or model_fetch.DEFAULT_REVISION)
        return ModelSource(HF_SCHEME, repo, hub=hub)
    if scheme == OCI_SCHEME:
        return ModelSource(OCI_SCHEME, OCI_MOUNT_DIR, image=rest)
    return ModelSource(scheme, model)


def problems(model: str) -> list[str]:
    """Why `spec.model` cannot be served, each saying what to write instead; [] when valid."""
    if re.fullmatch(MODEL_PATTERN, model):
        return []
    source = parse(model)
    if source.is_pvc:
        return [f"spec.model {model!r} is malformed: pvc://CLAIM/PATH needs a claim name "
                "(lowercase DNS name) and a path inside it without empty, . or .. segments"]
    if source.is_hf:
        return [f"spec.model {model!r} is malformed: hf://ORG/NAME[@REVISION] needs a hub repo "
                "id (letters, digits, -_.) and a revision without spaces"]
    if source.is_oci:
        return [f"spec.model {model!r} is malformed: oci://REGISTRY/REPO[:TAG|@DIGEST] needs an "
                "image reference with a lowercase registry and repository"]
    return [f"spec.model {model!r}: unknown scheme {source.scheme}://; the forms are {_FORMS}"]
