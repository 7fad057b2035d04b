"""Validation of rendered objects against the real Kubernetes schemas (kubernetes-validate).

Every object is checked strictly (unknown fields rejected) against each Kubernetes minor from
1.27 to the newest schema kubernetes-validate ships. A kind with no schema is an error here,
not a warning: the charts and the operator only produce built-in kinds and the CRD.
"""

from __future__ import annotations

from functools import cache

import kubernetes_validate
from kubernetes_validate import utils
from packaging.version import Version

OLDEST = "1.27"


@cache
def versions() -> list[str]:
    """Every supported minor from OLDEST to the newest, e.g. ['1.27.0', ..., '1.37.0']."""
    found = sorted(set(utils.all_versions()), key=Version)
    return [v for v in found if Version(v) >= Version(OLDEST)]


def problems(obj: dict, what: str = "") -> list[str]:
    """One line per (version, error); empty when the object is valid everywhere."""
    out = []
    label = what or f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    for v in versions():
        try:
            kubernetes_validate.validate(obj, v, strict=True)
        except utils.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            out.append(f"{label} against {v}: {path}: {e.message}")
        except utils.SchemaNotFoundError as e:
            out.append(f"{label} against {v}: {e.message}")
    return out
