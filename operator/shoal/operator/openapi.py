"""Building blocks of a structural OpenAPI v3 schema (what a CRD's `openAPIV3Schema` is): every
node typed and described, so the API server can prune, default and validate, and
`kubectl explain` has something to say."""

from __future__ import annotations

from enum import Enum


def typed(type_: str, description: str, **extra) -> dict:
    return {"type": type_, "description": description, **extra}


def obj(description: str, properties: dict, *, required: list[str] | None = None,
        **extra) -> dict:
    out = {"type": "object", "description": description, "properties": properties, **extra}
    if required:
        out["required"] = required
    return out


def values(enum: type[Enum]) -> list[str]:
    """A str enum's values, in definition order: the schema's `enum:` list."""
    return [m.value for m in enum]


def opaque(description: str) -> dict:
    """An object passed through as written (a volume source, a `valueFrom`)."""
    return obj(description, {}, **{"x-kubernetes-preserve-unknown-fields": True})
