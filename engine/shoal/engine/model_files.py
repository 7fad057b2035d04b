"""Where `shoal serve MODEL` finds a model's files, as vLLM does: a local directory as given
(checked first), else a Hugging Face hub id resolved with the real `huggingface_hub` client.

A hub id is one `snapshot_download` at `--revision` (default main) into the cache: `--download-dir`
when given (vLLM passes it as cache_dir), else `HF_HUB_CACHE` / `HF_HOME/hub`; only the files an
engine reads (shoal.contract.model_fetch.ENGINE_FILES, vLLM's allow_patterns for safetensors
weights). With HF_HUB_OFFLINE=1, or when the hub cannot be reached, the library answers from
the cache; online it downloads what the cache lacks (`--hf-token`, else HF_TOKEN). The same
applies to `--tokenizer` (at `--tokenizer-revision`, default the model's revision). This is what
the operator's hf:// pods run: `shoal fetch` fills /model-cache/hub in an init container, then
`shoal serve ORG/NAME --revision R --download-dir /model-cache/hub` with HF_HUB_OFFLINE=1.

Failures are ResolveErrors naming the id, the revision and the cache looked in, with the
termination cause and exit code: missing (offline, or the hub says not found) and access denied
are permanent (exit 2); a hub that cannot be reached for a model the cache lacks is transient
(exit 1, a restart may find it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shoal.contract.model_fetch import DEFAULT_REVISION, ENGINE_FILES
from shoal.contract.termination import Cause

# vLLM's LoadConfig.ignore_patterns default: the original (non-HF) checkpoint of Llama repos.
DEFAULT_IGNORE = ("original/**/*",)


class ResolveError(Exception):
    def __init__(self, message: str, cause: Cause, exit_code: int) -> None:
        super().__init__(message)
        self.cause, self.exit_code = cause, exit_code


@dataclass(frozen=True)
class Resolved:
    path: str  # the local directory to load from
    how: str  # for the start-up line


def is_hub_id(name: str) -> bool:
    """ORG/NAME or NAME by the hub's rules (huggingface_hub's validate_repo_id)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve(name: str, *, revision: str | None = None, download_dir: str | None = None,
            token: str | bool | None = None, ignore_patterns: tuple[str, ...] = DEFAULT_IGNORE,
            what: str = "model") -> Resolved:
    """The local directory for `name` (module docstring); a directory wins, as in vLLM."""
    if os.path.isdir(name):
        return Resolved(name, f"{what} {name}: a local directory")
    if not is_hub_id(name):  # a path that does not exist: EngineConfig says so
        return Resolved(name, f"{what} {name}: not a directory, not a hub id")
    from huggingface_hub import constants, snapshot_download

    revision = revision or DEFAULT_REVISION
    cache = os.path.abspath(download_dir or constants.HF_HUB_CACHE)
    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        path = snapshot_download(name, revision=revision, cache_dir=cache, token=token,
                                 allow_patterns=list(ENGINE_FILES),
                                 ignore_patterns=list(ignore_patterns) or None)
    except Exception as exc:  # noqa: BLE001 - every failure is classified and named
        raise classify(exc, name, revision, cache, offline, token, what) from None
    where = "offline, from the cache" if offline else "from the cache or the hub"
    return Resolved(path, f"{what} {name}@{revision}: {path} ({where} {cache})")


_TOKEN = "--hf-token / HF_TOKEN"


def classify(exc: Exception, name: str, revision: str, cache: str, offline: bool, token,
             what: str = "model") -> ResolveError:
    """The ResolveError for what snapshot_download raised (never raises)."""
    names = {k.__name__ for k in type(exc).__mro__}
    status = getattr(getattr(exc, "response", None), "status_code", None)
    said = " ".join(str(exc).split())[:400]
    head = f"{what} {name!r} (no such local directory; as a hub id) at revision {revision!r}"
    given = "a token was given" if token or os.environ.get("HF_TOKEN") else "no token was given"
    # Most specific first: the classes nest (GatedRepoError is a RepositoryNotFoundError), and
    # the hub answers 401 for a repository that does not exist as for a private one.
    if "GatedRepoError" in names or "DisabledRepoError" in names:
        return ResolveError(f"{head}: access denied by the hub ({given}; {_TOKEN}): {said}",
                            Cause.MODEL_ACCESS_DENIED, 2)
    if "RevisionNotFoundError" in names:
        return ResolveError(f"{head}: the hub has no such revision (cache {cache})",
                            Cause.MODEL_NOT_FOUND, 2)
    if "RepositoryNotFoundError" in names:
        return ResolveError(f"{head}: the hub has no such repository, or it is private and "
                            f"{given} ({_TOKEN}); cache {cache}", Cause.MODEL_NOT_FOUND, 2)
    if status in (401, 403):
        return ResolveError(f"{head}: access denied by the hub (HTTP {status}; {given}; "
                            f"{_TOKEN}): {said}", Cause.MODEL_ACCESS_DENIED, 2)
    if "IncompleteSnapshotError" in names or "LocalEntryNotFoundError" in names:
        missing = "is incomplete" if "IncompleteSnapshotError" in names else "is not"
        if offline:
            return ResolveError(f"{head} {missing} in the Hugging Face cache {cache} and "
                                "HF_HUB_OFFLINE is set (fetch it there first, or pass the "
                                f"cache with --download-dir): {said}", Cause.MODEL_NOT_FOUND, 2)
        return ResolveError(f"{head} {missing} in the Hugging Face cache {cache} and the hub "
                            f"could not be reached: {said}", Cause.DOWNLOAD_FAILED, 1)
    return ResolveError(f"{head}: downloading into {cache} failed: {type(exc).__name__}: {said}",
                        Cause.DOWNLOAD_FAILED, 1)
