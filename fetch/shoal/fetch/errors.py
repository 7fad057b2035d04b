"""Why a fetch failed, as the operator needs it: a cause, a message naming the repository, and
the exit code (2 permanent, 1 transient: the operator
recreates the group with spec.restartPolicy's back-off; engine pods never restart in place).

huggingface_hub raises one exception class per hub answer (hf_raise_for_status reads the status
and the X-Error-Code header); the rules below map them, most specific first, because the classes
nest: GatedRepoError is a RepositoryNotFoundError, LocalEntryNotFoundError is an
EntryNotFoundError, OfflineModeIsEnabled is a ConnectionError.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.contract.model_fetch import TOKEN_ENV, HubRef
from shoal.contract.termination import Cause, is_permanent

PERMANENT_EXIT = 2
TRANSIENT_EXIT = 1


@dataclass(frozen=True)
class Failure:
    cause: Cause
    message: str

    @property
    def exit_code(self) -> int:
        return PERMANENT_EXIT if is_permanent(self.cause) else TRANSIENT_EXIT


class HashMismatch(Exception):
    """Downloaded files differ from the hub's metadata (their blobs were deleted)."""


class NoEngineFiles(Exception):
    """The repository has none of the files an engine reads."""


@dataclass(frozen=True)
class Context:
    """What a message names besides the error."""

    ref: HubRef
    endpoint: str
    token_given: bool


def _token(ctx: Context) -> str:
    return (f"a token was given ({TOKEN_ENV}) and the hub refused it or it lacks access"
            if ctx.token_given else f"no token was given (set {TOKEN_ENV} from a Secret)")


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


# (class name in huggingface_hub.errors or the http module, cause, message template). Templates
# see {repo} (ORG/NAME), {rev}, {uri}, {endpoint}, {token} and {error}. Ordered: first match wins.
RULES: tuple[tuple[str, Cause, str], ...] = (
    ("HashMismatch", Cause.DOWNLOAD_FAILED, "{uri}: downloaded files differ from the hub's "
     "metadata and were deleted ({error}); the next try downloads them again"),
    ("NoEngineFiles", Cause.MODEL_NOT_FOUND, "{uri} at {endpoint} has no engine files "
     "({error})"),
    ("OfflineModeIsEnabled", Cause.CONFIG_ERROR, "HF_HUB_OFFLINE is set in the fetch container: "
     "it cannot reach {endpoint} to fetch {uri}"),
    ("GatedRepoError", Cause.MODEL_ACCESS_DENIED, "{repo} is a gated repository at {endpoint}: "
     "access denied, {token}"),
    ("RevisionNotFoundError", Cause.MODEL_NOT_FOUND, "revision {rev!r} of {repo} not found at "
     "{endpoint}"),
    ("RepositoryNotFoundError", Cause.MODEL_NOT_FOUND, "repository {repo} not found at "
     "{endpoint} (a private repository answers the same when {token})"),
    ("RemoteEntryNotFoundError", Cause.MODEL_NOT_FOUND, "a file of {uri} not found at "
     "{endpoint}: {error}"),
    ("DisabledRepoError", Cause.MODEL_ACCESS_DENIED, "{repo} is disabled at {endpoint}"),
)
# HTTP answers without a more specific class, by status.
STATUS_RULES: tuple[tuple[frozenset, Cause, str], ...] = (
    (frozenset({401, 403}), Cause.MODEL_ACCESS_DENIED, "access to {repo} denied at {endpoint} "
     "(HTTP {status}): {token}"),
    (frozenset({404}), Cause.MODEL_NOT_FOUND, "{uri} not found at {endpoint} (HTTP 404)"),
)
TRANSIENT = (Cause.DOWNLOAD_FAILED, "fetching {uri} from {endpoint} failed, will retry: {error}")


def _names(exc: BaseException) -> set[str]:
    return {k.__name__ for k in type(exc).__mro__}


def classify(exc: BaseException, ctx: Context, _depth: int = 0) -> Failure:
    """The Failure for an exception raised while fetching (never raises)."""
    names = _names(exc)
    # snapshot_download turns a hub error it cannot get past into "no local copy": the hub's own
    # answer is its __cause__, and that is what names the fault.
    if "LocalEntryNotFoundError" in names and exc.__cause__ is not None and _depth < 3:
        return classify(exc.__cause__, ctx, _depth + 1)
    fields = {"repo": ctx.ref.repo_id, "rev": ctx.ref.revision, "uri": ctx.ref.uri,
              "endpoint": ctx.endpoint, "token": _token(ctx), "error": _first_line(exc),
              "status": _status(exc)}
    for name, cause, template in RULES:
        if name in names:
            return Failure(cause, template.format(**fields))
    status = _status(exc)
    if "HfHubHTTPError" in names and status is not None:
        for statuses, cause, template in STATUS_RULES:
            if status in statuses:
                return Failure(cause, template.format(**fields))
    return Failure(TRANSIENT[0], TRANSIENT[1].format(**fields))


def is_transient(exc: BaseException) -> bool:
    """A network or hub fault (not a refusal, a not-found or a bad setting)."""
    ctx = Context(HubRef("-/-"), "", False)
    return classify(exc, ctx).cause == Cause.DOWNLOAD_FAILED


def scrub(text: str, secret: str | None) -> str:
    """Never print the token, whatever an error message carries."""
    return text.replace(secret, "***") if secret else text
