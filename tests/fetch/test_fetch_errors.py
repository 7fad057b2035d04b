"""Failure classification: the exceptions huggingface_hub itself raises for each hub answer
(hf_raise_for_status on real responses), mapped to a cause, an exit code and a message naming
the repository."""

from __future__ import annotations

import pytest
from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled
from huggingface_hub.utils import hf_raise_for_status
from huggingface_hub.utils import httpx as hx
from shoal.contract.model_fetch import HubRef
from shoal.contract.termination import Cause
from shoal.fetch.errors import Context, HashMismatch, NoEngineFiles, classify, scrub

REF = HubRef("acme/llama", "v2")
API = "https://hub.example/api/models/acme/llama/revision/v2"
RESOLVE = "https://hub.example/acme/llama/resolve/abc/model.safetensors"


def hub_error(status: int, url: str = API, **headers: str) -> Exception:
    """What the client raises for this answer."""
    response = hx.Response(status, headers=headers, request=hx.Request("GET", url))
    try:
        hf_raise_for_status(response)
    except Exception as exc:  # noqa: BLE001 - the exception is the point
        return exc
    raise AssertionError(f"{status} {headers} did not raise")


def wrapped(cause: Exception) -> Exception:
    """snapshot_download's way: no local copy, raised from the hub's answer."""
    try:
        raise LocalEntryNotFoundError("cannot find the requested files in the cache") from cause
    except LocalEntryNotFoundError as exc:
        return exc


CASES = [
    # (what, exception, cause, exit code, words the message must hold)
    ("missing repo", hub_error(404, **{"X-Error-Code": "RepoNotFound"}),
     Cause.MODEL_NOT_FOUND, 2, ["acme/llama", "not found"]),
    ("missing revision", hub_error(404, **{"X-Error-Code": "RevisionNotFound"}),
     Cause.MODEL_NOT_FOUND, 2, ["'v2'", "acme/llama"]),
    ("missing file", hub_error(404, RESOLVE, **{"X-Error-Code": "EntryNotFound"}),
     Cause.MODEL_NOT_FOUND, 2, ["hf://acme/llama@v2"]),
    ("gated", hub_error(401, **{"X-Error-Code": "GatedRepo"}),
     Cause.MODEL_ACCESS_DENIED, 2, ["acme/llama", "gated"]),
    ("wrong token", hub_error(401, **{"X-Error-Message":
                                      "Invalid credentials in Authorization header"}),
     Cause.MODEL_ACCESS_DENIED, 2, ["acme/llama", "401"]),
    ("forbidden", hub_error(403, RESOLVE), Cause.MODEL_ACCESS_DENIED, 2, ["acme/llama", "403"]),
    ("plain 404", hub_error(404, RESOLVE), Cause.MODEL_NOT_FOUND, 2, ["acme/llama"]),
    ("hub down", hub_error(503), Cause.DOWNLOAD_FAILED, 1, ["acme/llama", "503"]),
    ("rate limited", hub_error(429), Cause.DOWNLOAD_FAILED, 1, ["acme/llama"]),
    ("refused", hx.ConnectError("[Errno 111] Connection refused"),
     Cause.DOWNLOAD_FAILED, 1, ["acme/llama", "Connection refused"]),
    ("timeout", hx.ReadTimeout("timed out"), Cause.DOWNLOAD_FAILED, 1, ["ReadTimeout"]),
    ("cut mid-body", OSError("Consistency check failed: file should be of size 10 but has 4"),
     Cause.DOWNLOAD_FAILED, 1, ["Consistency check"]),
    ("hash mismatch", HashMismatch("model.safetensors: sha256 ab.., expected cd.."),
     Cause.DOWNLOAD_FAILED, 1, ["deleted", "model.safetensors"]),
    ("no engine files", NoEngineFiles("none of *.json among its files: a.bin"),
     Cause.MODEL_NOT_FOUND, 2, ["no engine files", "a.bin"]),
    ("offline", OfflineModeIsEnabled("offline"), Cause.CONFIG_ERROR, 2, ["HF_HUB_OFFLINE"]),
    ("no local copy after 401", wrapped(hub_error(401, RESOLVE, **{
        "X-Error-Message": "Invalid credentials in Authorization header"})),
     Cause.MODEL_ACCESS_DENIED, 2, ["acme/llama"]),
    ("no local copy after 500", wrapped(hub_error(500)), Cause.DOWNLOAD_FAILED, 1, ["500"]),
    ("no local copy, no cause", LocalEntryNotFoundError("nothing cached"),
     Cause.DOWNLOAD_FAILED, 1, ["acme/llama"]),
]


@pytest.mark.parametrize(("what", "exc", "cause", "code", "words"), CASES,
                         ids=[c[0] for c in CASES])
def test_classify(what, exc, cause, code, words) -> None:
    failure = classify(exc, Context(REF, "https://hub.example", token_given=False))
    assert (failure.cause, failure.exit_code) == (cause, code), (what, failure)
    for word in words:
        assert word in failure.message, (word, failure.message)


@pytest.mark.parametrize(("given", "says"), [(False, "no token was given"),
                                             (True, "a token was given")])
def test_access_denied_says_whether_a_token_was_given(given, says) -> None:
    exc = hub_error(401, **{"X-Error-Message": "Invalid credentials in Authorization header"})
    failure = classify(exc, Context(REF, "https://hub.example", token_given=given))
    assert says in failure.message and "HF_TOKEN" in failure.message


def test_the_token_never_reaches_the_message() -> None:
    assert scrub("Bearer hf_secret123 refused", "hf_secret123") == "Bearer *** refused"
    assert scrub("nothing to hide", None) == "nothing to hide"
