"""The model fetch: how the operator asks an init container for a model, and what it says back.

An engine pod whose `spec.model` is `hf://ORG/NAME[@REVISION]` starts with an init container,
FETCH_CONTAINER, that runs ``shoal fetch hf://ORG/NAME@REVISION --cache-dir CACHE_DIR``
(shoal.fetch, the real `huggingface_hub` client) into the model cache mounted at CACHE_MOUNT.
The engine container then starts on the hub id, resolved offline from that cache (vLLM's own
way: ``--download-dir CACHE_DIR`` with HF_HUB_OFFLINE=1), so a stock `vllm serve` reads the
same cache. The fetcher names its failure in the termination message (shoal.contract.termination):
MODEL_NOT_FOUND / MODEL_ACCESS_DENIED are permanent, DOWNLOAD_FAILED is transient (engine pods run
with restartPolicy Never, so the pod fails and the operator recreates the group with
spec.restartPolicy's back-off).

While it downloads, the fetcher prints PROGRESS lines on stdout; the operator reads the last
one from the container's log and shows it in the group's status and in an Event.

Standard library only, append-only: a pod of an older release reads what a newer operator sets.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

HF_SCHEME = "hf"
OCI_SCHEME = "oci"
FETCH_CONTAINER = "model-fetch"  # the init container's name, in every engine pod that fetches
CACHE_VOLUME = "model-cache"
CACHE_MOUNT = "/model-cache"  # the cache volume in the fetch and engine containers
CACHE_DIR = f"{CACHE_MOUNT}/hub"  # huggingface_hub's cache layout (models--ORG--NAME/...)
DEFAULT_REVISION = "main"
# The token the fetcher passes to the hub (huggingface_hub reads it), from the Secret the spec
# names; HF_ENDPOINT points the client at a mirror.
TOKEN_ENV = "HF_TOKEN"
ENDPOINT_ENV = "HF_ENDPOINT"

# What an engine needs from a repository (vLLM's allow_patterns for safetensors weights): the
# fetcher downloads only these.
ENGINE_FILES = (
    "*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja",
)
# What a router needs to tokenize as the engine does (routing kv-aware): the engine files but
# the weights. `shoal fetch --files tokenizer`, into a frontend pod's own cache.
TOKENIZER_FILES = tuple(p for p in ENGINE_FILES if p != "*.safetensors")
FILE_SETS = {"engine": ENGINE_FILES, "tokenizer": TOKENIZER_FILES}

# hf://ORG/NAME[@REVISION]: the hub's repo-id rules (letters, digits, `-_.`, no `--` or `..`
# edges are left to the hub), a revision without spaces or `@`.
_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
HF_PATTERN = rf"hf://{_ID}/{_ID}(@[A-Za-z0-9][A-Za-z0-9._/-]{{0,199}})?"
# hf://ORG/NAME without a revision: an InferenceAdapter's hub source (vLLM's load endpoint takes
# a repo id and loads its default revision).
HF_REPO_PATTERN = rf"hf://{_ID}/{_ID}"
# oci://REGISTRY/REPO[:TAG|@DIGEST]: a container image reference (lowercase repository path).
OCI_PATTERN = (r"oci://[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+"
               r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[a-f0-9]{64})?")


@dataclass(frozen=True)
class HubRef:
    """One hub model at one revision."""

    repo_id: str
    revision: str = DEFAULT_REVISION

    @property
    def uri(self) -> str:
        return f"hf://{self.repo_id}@{self.revision}"


def parse_hf(uri: str) -> HubRef:
    """`hf://ORG/NAME[@REV]` -> HubRef; ValueError naming the reference when malformed."""
    if not re.fullmatch(HF_PATTERN, uri):
        raise ValueError(f"{uri!r} is not hf://ORG/NAME[@REVISION]")
    repo, _, rev = uri[len("hf://"):].partition("@")
    return HubRef(repo, rev or DEFAULT_REVISION)


def fetch_command(ref: HubRef, files: str = "engine") -> list[str]:
    """The init container's command line; `files` names one of FILE_SETS."""
    extra = [] if files == "engine" else ["--files", files]
    return ["shoal", "fetch", ref.uri, "--cache-dir", CACHE_DIR, *extra]


def cached_snapshot(cache_dir: str, ref: HubRef) -> str:
    """The snapshot folder of `ref` in a huggingface_hub cache the fetcher filled (its
    refs/REVISION names the commit; a commit revision is its own); FileNotFoundError names the
    missing ref."""
    folder = os.path.join(cache_dir, "models--" + ref.repo_id.replace("/", "--"))
    commit = ref.revision
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        refs = os.path.join(folder, "refs", ref.revision)
        try:
            with open(refs) as f:
                commit = f.read().strip()
        except FileNotFoundError:
            raise FileNotFoundError(f"{ref.uri} is not in the cache {cache_dir} (no {refs}; "
                                    "`shoal fetch` writes it)") from None
    return os.path.join(folder, "snapshots", commit)


# -- progress ------------------------------------------------------------------------------
_GIB = 1024 ** 3
_PROGRESS = re.compile(r"^fetch (?P<repo>\S+): downloading (?P<done>[0-9.]+) of "
                       r"(?P<total>[0-9.]+) GiB$")


@dataclass(frozen=True)
class Progress:
    repo: str  # ORG/NAME@REV
    done_gib: float
    total_gib: float

    @property
    def text(self) -> str:
        """What status and Events say."""
        return f"downloading {self.done_gib:.1f} of {self.total_gib:.1f} GiB ({self.repo})"


def progress_line(ref: HubRef, done_bytes: int, total_bytes: int) -> str:
    """The line the fetcher prints (one per update, on stdout)."""
    return (f"fetch {ref.repo_id}@{ref.revision}: downloading {done_bytes / _GIB:.2f} of "
            f"{total_bytes / _GIB:.2f} GiB")


def parse_progress(log_tail: str) -> Progress | None:
    """The last progress line in a log tail, or None (no line of ours: nothing to show)."""
    for line in reversed(log_tail.splitlines()):
        found = _PROGRESS.match(line.strip())
        if found:
            return Progress(found["repo"], float(found["done"]), float(found["total"]))
    return None
