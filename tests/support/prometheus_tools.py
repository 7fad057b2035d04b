"""Real `prometheus` and `promtool` for the alert tests, from Debian's `prometheus` package.

Installed once per machine with apt-get (as root, like devcluster/shoal/devcluster/build.sh),
under a file lock so that concurrent test runs install once; dpkg's own lock is waited for
(another apt-get may be running). `--no-install-recommends`: the node exporter is not needed.
Debian starts the packaged service where services may start (not in containers, whose
policy-rc.d refuses); the tests never use it: they run their own `prometheus` on a free port.

A machine where it is missing and cannot be installed makes the tests fail with the reason
(`PrometheusMissing`), never skip.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from support.k8s_tools import cache_dir

PACKAGE = "prometheus"  # Debian bookworm: 2.42.0+ds


class PrometheusMissing(RuntimeError):
    """promtool or prometheus is not installed and could not be; str() says why."""


@dataclass(frozen=True)
class PrometheusTools:
    prometheus: Path
    promtool: Path


def _found() -> PrometheusTools | None:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus and promtool:
        return PrometheusTools(Path(prometheus), Path(promtool))
    return None


def _apt(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=600", *args], env=env,
                          capture_output=True, text=True, timeout=900)


def _install() -> None:
    if os.geteuid() != 0:
        raise PrometheusMissing(f"promtool/prometheus not on PATH and not root: install Debian's "
                                f"`{PACKAGE}` package (apt-get install {PACKAGE})")
    if shutil.which("apt-get") is None:
        raise PrometheusMissing(f"promtool/prometheus not on PATH and no apt-get to install "
                                f"Debian's `{PACKAGE}` package")
    install = ("install", "-y", "-qq", "--no-install-recommends", PACKAGE)
    proc = _apt(*install)
    if proc.returncode != 0:  # a fresh machine: no package lists yet
        update = _apt("update", "-qq")
        if update.returncode != 0:
            raise PrometheusMissing(f"apt-get update failed: {update.stderr.strip()[-2000:]}")
        proc = _apt(*install)
    if proc.returncode != 0:
        raise PrometheusMissing(f"apt-get install {PACKAGE} failed (exit {proc.returncode}): "
                                f"{proc.stderr.strip()[-2000:]}")


def ensure_prometheus() -> PrometheusTools:
    """The installed tools, installing Debian's package first where needed."""
    tools = _found()
    if tools is not None:
        return tools
    lock_dir = cache_dir() / "tools"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / ".prometheus.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _found() is None:
            _install()
    tools = _found()
    if tools is None:
        raise PrometheusMissing(f"apt-get installed {PACKAGE}, but prometheus/promtool are "
                                f"still not on PATH ({os.environ.get('PATH')})")
    return tools


if __name__ == "__main__":
    t = ensure_prometheus()
    print(f"prometheus: {t.prometheus}\npromtool:   {t.promtool}")
