"""A stand-in for the Hugging Face Hub: the HTTP calls `huggingface_hub` makes to fetch a model.

This is a stand-in, not a hub: nothing real can run here (there is no internet to the real hub,
and the hub's server is not open source). What it exercises is real: the `huggingface_hub` client
(the version pinned in pyproject, 2.4.0), its cache layout, locks, redirects, retries and error
classes, and `shoal fetch` on top. It answers exactly the calls that version makes for
`HfApi.model_info(files_metadata=True)` and `snapshot_download` (read from its source:
hf_api.py model_info / list_repo_tree, file_download.py get_hf_file_metadata / http_get,
utils/_http.py hf_raise_for_status), with the headers the client reads:

  GET  /api/models/ORG/NAME[/revision/REV][?blobs=true]   model_info (siblings; with blobs:
       size, blobId, lfs {size, sha256, pointerSize})
  GET  /api/models/ORG/NAME/tree/REV?recursive=...          list_repo_tree (one page, no Link)
  HEAD|GET /ORG/NAME/resolve/REV/PATH                        file metadata / body: X-Repo-Commit,
       ETag (git blob id; sha256 for LFS files), X-Linked-Etag + X-Linked-Size for LFS files,
       Content-Length, Accept-Ranges, Range -> 206 + Content-Range. With --cdn-url, an LFS file
       answers 302 to CDN_URL/_cdn/ORG/NAME/COMMIT/PATH instead (a different origin, as the
       hub's CDN is: the client keeps the metadata of the 302 and drops its token for the GET)
  GET  /api/agent-harnesses                                 the client's agent registry (its
       user-agent telemetry, fetched once a day): an empty one
  GET  /_stats                                               {"downloads": {"ORG/NAME/PATH": n},
       "requests": n, "api_calls": {"ORG/NAME": n}}: a GET that sends a file's body counts one
       download (a ranged resume is another); every request counts in requests, and each
       /api/models/ORG/NAME... call (model_info, tree) in api_calls

What it leaves out: Xet storage (no X-Xet-Hash header, so the client downloads over plain HTTP,
as it does for any hub file without one), pagination (one page), and everything but models.

Repositories are the directories DIR/ORG/NAME/ (plain files of a model directory, read when first
asked for; names starting with "." are not part of it). Revision "main" and the commit sha are
the same snapshot; the sha is a stable fake, the sha1 of the files' names and sha256s. LFS files
are the weights (*.safetensors, *.bin, *.pt, *.pth, *.gguf) and anything of 10 MiB or more.

Errors as the hub sends them (X-Error-Code / X-Error-Message headers, {"error": ...} body):
unknown repository 404 RepoNotFound; unknown revision 404 RevisionNotFound; unknown file 404
EntryNotFound (with X-Repo-Commit); with --token, a request without it 401 GatedRepo and one with
another token 401 "Invalid credentials in Authorization header". /_cdn and /_stats need no token
(the hub's CDN URLs are signed instead).

Standard library only: it runs in a pod of the router image from a ConfigMap,
`python stand_in_hub.py --root DIR --port PORT [--token TOKEN] [--cdn-url URL]`.
`--throttle BYTES_PER_S` slows bodies down (for tests that stop it mid-download).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
LFS_MIN_SIZE = 10 << 20
MAIN = "main"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class File:
    path: str  # in the repository, "/"-separated
    disk: Path
    size: int
    sha256: str
    blob_id: str  # git object id of what git stores: the content, or the LFS pointer
    lfs: bool
    pointer_size: int


@dataclass(frozen=True)
class Repo:
    repo_id: str
    commit: str
    files: dict[str, File]
    modified: str


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def load_repo(root: Path, repo_id: str) -> Repo | None:
    """The snapshot of DIR/ORG/NAME, or None when there is no such directory."""
    base = root / repo_id
    if not base.is_dir():
        return None
    files: dict[str, File] = {}
    for disk in sorted(base.rglob("*")):
        rel = disk.relative_to(base)
        if not disk.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        size = disk.stat().st_size
        sha = _sha256(disk)
        lfs = disk.suffix in LFS_SUFFIXES or size >= LFS_MIN_SIZE
        if lfs:
            pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\n"
                       f"size {size}\n").encode()
            blob_id, pointer_size = _git_blob_id(pointer), len(pointer)
        else:
            blob_id, pointer_size = _git_blob_id(disk.read_bytes()), 0
        files[rel.as_posix()] = File(rel.as_posix(), disk, size, sha, blob_id, lfs, pointer_size)
    commit = hashlib.sha1("".join(f"{p}\0{f.sha256}\n" for p, f in files.items()).encode())
    stamp = max((f.disk.stat().st_mtime for f in files.values()), default=0.0)
    modified = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(stamp))
    return Repo(repo_id, commit.hexdigest(), files, modified)


def sibling(f: File, blobs: bool) -> dict:
    out: dict = {"rfilename": f.path}
    if blobs:
        out.update(size=f.size, blobId=f.blob_id)
        if f.lfs:
            out["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": f.pointer_size}
    return out


def model_info(repo: Repo, blobs: bool) -> dict:
    org = repo.repo_id.split("/")[0]
    return {"_id": repo.commit[:24], "id": repo.repo_id, "modelId": repo.repo_id, "author": org,
            "sha": repo.commit, "lastModified": repo.modified, "createdAt": repo.modified,
            "private": False, "gated": False, "disabled": False, "downloads": 0, "likes": 0,
            "tags": ["transformers", "safetensors"], "library_name": "transformers",
            "siblings": [sibling(f, blobs) for f in repo.files.values()]}


def tree(repo: Repo, recursive: bool) -> list[dict]:
    """list_repo_tree's entries: files, and the directories above them."""
    entries, dirs = [], set()
    for f in repo.files.values():
        parts = f.path.split("/")
        if len(parts) > 1 and not recursive:
            dirs.add(parts[0])
            continue
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]))
        entry = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
        if f.lfs:
            entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
        entries.append(entry)
    folders = [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0,
                "path": d} for d in sorted(dirs)]
    return folders + entries


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """`bytes=A-B` / `bytes=A-` / `bytes=-N` -> (start, end inclusive); None: whole file."""
    if not header:
        return None
    found = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not found or (not found[1] and not found[2]):
        return None
    if not found[1]:
        start, end = max(size - int(found[2]), 0), size - 1
    else:
        start, end = int(found[1]), int(found[2]) if found[2] else size - 1
    return start, min(end, size - 1)


class Hub:
    """The repositories, the options and the counters, shared by the handler threads."""

    def __init__(self, root: Path, token: str | None, cdn_url: str | None,
                 throttle: float | None) -> None:
        self.root, self.token, self.cdn_url, self.throttle = root, token, cdn_url, throttle
        self.lock = threading.Lock()
        self.repos: dict[str, Repo] = {}
        self.downloads: dict[str, int] = {}
        self.api_calls: dict[str, int] = {}
        self.requests = 0

    def repo(self, repo_id: str) -> Repo | None:
        with self.lock:
            if repo_id not in self.repos:
                found = load_repo(self.root, repo_id)
                if found is None:
                    return None
                self.repos[repo_id] = found
            return self.repos[repo_id]

    def count(self, key: str | None = None, table: str = "downloads") -> None:
        with self.lock:
            if key is None:
                self.requests += 1
            else:
                counts = getattr(self, table)
                counts[key] = counts.get(key, 0) + 1

    def stats(self) -> dict:
        with self.lock:
            return {"downloads": dict(self.downloads), "requests": self.requests,
                    "api_calls": dict(self.api_calls)}


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+)|/tree/([^/]+)(/.*)?)?/?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_CDN = re.compile(r"^/_cdn/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)$")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "stand-in-hub/1"
    hub: Hub  # set on the subclass by make_server

    def log_message(self, fmt, *args) -> None:  # one line per request, on stderr
        status = args[1] if len(args) > 1 else ""
        sys.stderr.write(f"stand-in hub: {self.command} {self.path} {status}\n")

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    # -- dispatch ------------------------------------------------------------------------------
    def _serve(self, body: bool) -> None:
        self.hub.count()
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if url.path == "/_stats":
                return self._json(200, self.hub.stats(), body)
            if url.path == "/api/agent-harnesses":
                return self._json(200, {"standardEnvVars": [], "harnesses": {}}, body)
            if found := _CDN.match(url.path):
                return self._cdn(found, body)
            self._authorize(url.path)
            if found := _API.match(url.path):
                self.hub.count(unquote(found[1]), "api_calls")
                return self._api(found, query, body)
            if found := _RESOLVE.match(url.path):
                return self._resolve(found, body)
            raise HubError(404, f"no route for {url.path}")
        except HubError as err:
            self._error(err, body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-body
        except Exception as exc:  # noqa: BLE001 - answered, not dropped: the client names it
            self._error(HubError(500, f"stand-in hub: {type(exc).__name__}: {exc}"), body)

    def _error(self, err: HubError, body: bool) -> None:
        headers = dict(err.headers)
        if err.code:
            headers["X-Error-Code"] = err.code
        headers["X-Error-Message"] = err.message
        self._json(err.status, {"error": err.message}, body, headers)

    def _authorize(self, path: str) -> None:
        if self.hub.token is None:
            return
        given = self.headers.get("Authorization", "")
        if given == f"Bearer {self.hub.token}":
            return
        if not given:
            repo = "/".join(path.split("/")[3:5] if path.startswith("/api/") else
                            path.split("/")[1:3])
            raise HubError(401, f"Access to model {repo} is restricted. You must have access to "
                           "it and be authenticated to access it. Please log in.", "GatedRepo")
        raise HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str, revision: str) -> Repo:
        repo = self.hub.repo(unquote(repo_id))
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        if unquote(revision) not in (MAIN, repo.commit):
            raise HubError(404, f"Invalid rev id: {unquote(revision)}", "RevisionNotFound")
        return repo

    def _api(self, found: re.Match, query: dict, body: bool) -> None:
        repo_id, rev, tree_rev, sub = found.groups()
        if tree_rev is not None:
            repo = self._repo(repo_id, tree_rev)
            recursive = query.get("recursive", "false").lower() in ("true", "1")
            entries = tree(repo, recursive)
            if sub:
                prefix = unquote(sub).strip("/") + "/"
                entries = [e for e in entries if e["path"].startswith(prefix)]
            return self._json(200, entries, body)
        repo = self._repo(repo_id, rev or MAIN)
        blobs = query.get("blobs", "false").lower() in ("true", "1")
        self._json(200, model_info(repo, blobs), body)

    def _resolve(self, found: re.Match, body: bool) -> None:
        repo_id, rev, path = found.groups()
        repo = self._repo(repo_id, rev)
        f = repo.files.get(unquote(path))
        commit = {"X-Repo-Commit": repo.commit}
        if f is None:
            raise HubError(404, "Entry not found", "EntryNotFound", commit)
        headers = {**commit, "ETag": f'"{f.sha256 if f.lfs else f.blob_id}"'}
        if f.lfs:
            headers.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)})
            if self.hub.cdn_url:
                cdn = self.hub.cdn_url.rstrip("/")
                location = f"{cdn}/_cdn/{repo.repo_id}/{repo.commit}/{f.path}"
                return self._send(302, b"", body, {**headers, "Location": location,
                                                   "Content-Type": "text/plain"})
        self._file(repo, f, body, headers)

    def _cdn(self, found: re.Match, body: bool) -> None:
        repo_id, commit, path = found.groups()
        repo = self.hub.repo(unquote(repo_id))
        f = repo.files.get(unquote(path)) if repo is not None and repo.commit == commit else None
        if f is None:
            raise HubError(404, "Not Found")
        self._file(repo, f, body, {"ETag": f'"{f.sha256}"'})

    # -- answers ---------------------------------------------------------------------------------
    def _file(self, repo: Repo, f: File, body: bool, headers: dict) -> None:
        span = parse_range(self.headers.get("Range"), f.size)
        start, end = span if span else (0, f.size - 1)
        headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                   "Content-Length": str(max(end - start + 1, 0))}
        status = 200
        if span is not None:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if not body:
            return
        self.hub.count(f"{repo.repo_id}/{f.path}")
        self._stream(f.disk, start, end - start + 1)

    def _stream(self, disk: Path, start: int, length: int) -> None:
        chunk = _CHUNK if not self.hub.throttle else max(int(self.hub.throttle / 10), 1)
        t0, sent = time.monotonic(), 0
        with open(disk, "rb") as src:
            src.seek(start)
            while sent < length:
                data = src.read(min(chunk, length - sent))
                if not data:
                    break
                self.wfile.write(data)
                sent += len(data)
                if self.hub.throttle:
                    ahead = sent / self.hub.throttle - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)

    def _json(self, status: int, obj, body: bool, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), body,
                   {**(headers or {}), "Content-Type": "application/json"})

    def _send(self, status: int, data: bytes, body: bool, headers: dict) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


def make_server(root: Path, host: str, port: int, token: str | None = None,
                cdn_url: str | None = None, throttle: float | None = None) -> ThreadingHTTPServer:
    hub = Hub(root, token, cdn_url, throttle)
    handler = type("BoundHandler", (Handler,), {"hub": hub})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A stand-in Hugging Face Hub (see the docstring).")
    p.add_argument("--root", required=True, type=Path, help="DIR holding ORG/NAME/ directories")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--token", default=os.environ.get("STAND_IN_HUB_TOKEN") or None,
                   help="require this Bearer token on hub calls")
    p.add_argument("--cdn-url", default=None,
                   help="answer LFS files with a 302 to this origin's /_cdn/ (another origin)")
    p.add_argument("--throttle", type=float, default=None, help="bytes per second per body")
    args = p.parse_args(argv)
    server = make_server(args.root, args.host, args.port, args.token, args.cdn_url, args.throttle)
    host, port = server.server_address[:2]
    print(f"stand-in hub: serving {args.root} on http://{host}:{port}"
          f"{' (token required)' if args.token else ''}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
