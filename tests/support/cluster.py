"""The `cluster` fixture: the local cluster with real nodes (shoal.devcluster, docs/cluster.md)
with the operator installed from the Helm chart, for the end-to-end tier (tests/e2e/).

Build: binaries and images are prepared in `pytest_collection_finish` (`python -m
shoal.devcluster prepare`, a no-op when cached; cold ~20 minutes), before any per-test timeout
starts, and only when a collected test uses `cluster`. A failure there makes every such test fail
with the build's output; the tier never skips by itself.

Start: `python -m shoal.devcluster start` (it removes leftovers of a killed run first). A
cluster that `make cluster` left running is reused and left running; one this session started is
stopped and removed at the end. On a failed test the logs of every component and the cluster's
state are attached to the report (section "cluster logs").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from shoal.devcluster import demo
from shoal.devcluster.images import ENGINE_TAG as ENGINE_IMAGE
from shoal.devcluster.layout import MODEL_HOST_DIR, logs_dir
from support.builders import engine
from support.k8s_tools import KubeCli, ensure_k8s_tools
from support.models import ensure_model

DEVCLUSTER = (sys.executable, "-m", "shoal.devcluster")
MODEL_MOUNT = "/models"

_prepare_error: str | None = None


def _uses_cluster(items) -> bool:
    return any("cluster" in getattr(item, "fixturenames", ()) for item in items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """`prepare` when a collected test uses `cluster`; then the vLLM image (about 6 GB, not part
    of prepare: `image vllm`) only when one also uses `vllm_image` (tests/support/vllm_image.py)."""
    global _prepare_error
    if session.config.option.collectonly or not _uses_cluster(session.items):
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    say = tr.write_line if tr is not None else print
    steps = [("prepare", "binaries and images (python -m shoal.devcluster prepare; cached "
              "after the first run)")]
    if any("vllm_image" in getattr(item, "fixturenames", ()) for item in session.items):
        steps.append(("image vllm", "the vLLM image (python -m shoal.devcluster image vllm; "
                      "cached after the first run, ~15 min cold)"))
    for step, what in steps:
        say(f"cluster: preparing {what}")
        t0 = time.monotonic()
        proc = subprocess.Popen([*DEVCLUSTER, *step.split()], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-60:]
            if line.startswith(("[cluster", "[k8s-build")):
                say("  " + line.rstrip())
        if proc.wait() != 0:
            _prepare_error = f"`{step}` failed:\n" + "\n".join(tail)
            say(f"cluster: {step} FAILED; tests using `cluster` will fail")
            return
        if time.monotonic() - t0 > 5:
            say(f"cluster: {step} done in {time.monotonic() - t0:.0f}s")


class Cluster:
    """Handle for tests: kubeconfig, kubectl/helm, the Python client, namespaces, logs."""

    def __init__(self, state: dict, reused: bool) -> None:
        self.state = state
        self.reused = reused
        self.kubeconfig = state["kubeconfig"]
        self.logs = Path(state["logs"])
        self.tools = ensure_k8s_tools()
        self.cli = KubeCli(self.tools, self.kubeconfig)
        self.env = self.cli.env

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120,
                input: str | None = None) -> subprocess.CompletedProcess:
        return self.cli.kubectl(*args, check=check, timeout=timeout, input=input)

    def helm(self, *args: str, timeout: float = 300) -> str:
        return self.cli.helm(*args, timeout=timeout).stdout

    def get(self, *args: str) -> dict:
        return self.cli.get_json(*args)

    def api_client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=self.kubeconfig)

    def new_namespace(self, prefix: str) -> str:
        name = f"{prefix[:40].rstrip('-')}-{uuid.uuid4().hex[:6]}"
        self.kubectl("create", "namespace", name)
        self.kubectl("label", "namespace", name, "shoal-test=e2e")
        return name

    def apply(self, obj: dict) -> None:
        self.kubectl("apply", "-f", "-", input=json.dumps(obj))

    def report(self) -> str:
        """Everything one needs to see why a test failed: objects, events, every log's tail."""
        parts = []
        for args in (("get", "nodes,pods,svc,ie", "-A", "-o", "wide"),
                     ("get", "events", "-A", "--sort-by=.lastTimestamp"),
                     ("logs", "-n", "shoal-system", "deploy/shoal-operator", "--tail=80")):
            res = self.kubectl(*args, check=False, timeout=30)
            parts.append(f"$ kubectl {' '.join(args)}\n{res.stdout[-6000:]}{res.stderr[-2000:]}")
        for log in sorted(self.logs.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-30:]
            parts.append(f"--- {log} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n\n".join(parts)


def _run_cluster(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([*DEVCLUSTER, *args], capture_output=True, text=True, timeout=timeout)


# Package scope (tests/e2e): the cluster goes away when the tier is done, not at the end of the
# whole session, so the rest of the suite does not share the 2 cores with an idle cluster.
@pytest.fixture(scope="package")
def cluster():
    if _prepare_error is not None:
        pytest.fail(f"cluster prepare failed:\n{_prepare_error}", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("the e2e tier needs root (network namespaces, mounts, cgroups)",
                    pytrace=False)
    reused = _run_cluster("status", timeout=30).returncode == 0
    res = _run_cluster("start", timeout=900)
    if res.returncode != 0:
        tails = "\n".join(f"--- {p}\n" + "\n".join(p.read_text(errors="replace")
                                                    .splitlines()[-25:])
                          for p in sorted(logs_dir().glob("*.log")))
        _run_cluster("stop", timeout=300)
        pytest.fail(f"the cluster did not come up:\n{res.stderr[-6000:]}\n{tails}", pytrace=False)
    state = json.loads(res.stdout)
    handle = Cluster(state, reused)
    try:
        demo.install_model(ensure_model("shoal-tiny", "tiny"))
        demo.install_operator(demo.Kube(handle.kubeconfig, handle.tools.kubectl,
                                        handle.tools.helm))
        yield handle
    finally:
        for ns in handle.kubectl("get", "ns", "-l", "shoal-test=e2e", "-o", "name",
                                 check=False).stdout.split():
            handle.kubectl("delete", ns, "--wait=false", check=False)
        if not reused:
            stop = _run_cluster("stop", timeout=300)
            if stop.returncode != 0:
                raise AssertionError(f"cluster teardown left things behind:\n{stop.stderr[-3000:]}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and "cluster" in getattr(item, "funcargs", {}):
        try:
            rep.sections.append(("cluster logs", item.funcargs["cluster"].report()))
        except Exception as exc:  # noqa: BLE001 - the report must not hide the failure
            rep.sections.append(("cluster logs", f"(could not collect: {exc})"))


def inference_engine(name: str, *, replicas: int = 1, nodes_per_group: int = 1,
                     tensor_parallel: int = 1, shutdown_s: int = 10, extra_args=None,
                     backoff_base: int = 2, max_model_len: int = 1024, model: str | None = None,
                     engine_overrides: dict | None = None, **spec) -> dict:
    """An InferenceEngine serving the project's tiny model from the nodes' hostPath (built with
    the suite's one builder, support.builders); `model` (hf://, oci://) replaces that volume;
    `engine_overrides` replaces `spec.engine` fields (resources, env)."""
    b = (engine(name, namespace=None)
         .set(model=model or f"{MODEL_MOUNT}/shoal-tiny", servedModelName="shoal-tiny",
              image=ENGINE_IMAGE))
    if model is None:
        b = b.model_volume(MODEL_MOUNT, {"hostPath": {"path": str(MODEL_HOST_DIR),
                                                      "type": "Directory"}})
    return (b.groups(replicas).ranks(nodes_per_group, tp=tensor_parallel).drain(shutdown_s)
            .engine(extraArgs=["--max-model-len", str(max_model_len), "--max-num-seqs", "16",
                               *(extra_args or [])],
                    **{"startupTimeoutSeconds": 300,
                       "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                                     "limits": {"memory": "4Gi"}},
                       **(engine_overrides or {})})
            .frontend(replicas=1, resources={"requests": {"cpu": "50m", "memory": "64Mi"}})
            .restart(backoffBaseSeconds=backoff_base, backoffMaxSeconds=30)
            .set(**spec)
            .manifest())
