"""A rendered `runtime: VLLM` engine pod played on this machine, container by container: the
`install-supervisor` init container's `cp` of the real bundle (shoal.supervisor.bundle), then the
engine container's own `command + args` and env, with the pod's paths under a temporary root and
a stand-in `vllm` on PATH (a Python script: vLLM's process titles, or vLLM's real output
replayed). What the supervisor writes at the container's terminationMessagePath is the pod's
terminated state, read back by the operator (failures.py, plan.py).

So the contract is checked end to end on one side's real code and the other's: the paths the
operator renders are the ones the bundle is copied to and run from, the image's bare `python3`
runs it, the separator is the one the supervisor parses, and its message gives the operator the
process, the cause and the restart decision."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from shoal.contract import supervisor as sv
from shoal.contract.termination import DEFAULT_PATH
from shoal.operator import labels as L
from shoal.operator import render
from shoal.operator.failures import failure_of
from shoal.operator.plan import Memory, Observed, plan
from shoal.operator.spec import parse
from support.builders import engine

pytestmark = pytest.mark.process

DATA = Path(__file__).resolve().parents[1] / "supervisor" / "data"  # real vLLM 0.32.0 output
TIMEOUT = 60
NOW = dt.datetime(2026, 12, 2, 10, 0, 0, tzinfo=dt.timezone.utc)
VLLM = engine("llm", "ns").set(runtime="VLLM", image="vllm/vllm-openai:v0.32.0")

# The stand-in `vllm`: kills its EngineCore as `kill -9` would, then exits 0 as `vllm serve`
# does when its EngineCore was killed (measured: /work/vllm-logs f-kill-enginecore).
KILLS_ENGINE_CORE = """
    import os, signal, subprocess, sys, time
    assert sys.argv[1] == "serve", sys.argv
    core = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore_DP0 sleep 60"])
    time.sleep(1.5)  # the supervisor scans /proc every 0.5 s
    os.kill(core.pid, signal.SIGKILL)
    time.sleep(2)  # a zombie for a while: its exit status can be read
    core.wait()
    sys.exit(0)
"""
# vLLM's real output for `--max-model-len 100000` on a 2048-position model, replayed.
REPLAYS = """
    import json, sys
    from pathlib import Path
    data = Path({data!r})
    sys.stdout.write((data / "{case}.out").read_text()); sys.stdout.flush()
    sys.stderr.write((data / "{case}.err").read_text()); sys.stderr.flush()
    sys.exit(json.loads((data / "{case}.json").read_text())["exit_code"])
"""


@pytest.fixture(scope="module")
def built_bundle(tmp_path_factory) -> Path:
    """What the router image carries at BUNDLE_IN_IMAGE (the Dockerfile builds it so)."""
    from shoal.supervisor import bundle

    return bundle.build(tmp_path_factory.mktemp("bundle") / sv.BUNDLE_NAME)


def _local(root: Path, arg: str) -> str:
    """A path of the pod's (the shared volume, the image's bundle, the message file) under root."""
    for prefix in (sv.MOUNT, os.path.dirname(sv.BUNDLE_IN_IMAGE), DEFAULT_PATH):
        if arg == prefix or arg.startswith(prefix + "/"):
            return str(root / arg.lstrip("/"))
    return arg


def _run(container: dict, root: Path, path_dirs: list[Path], env: dict | None = None):
    argv = [_local(root, a) for a in container.get("command", []) + container.get("args", [])]
    env = {"PATH": os.pathsep.join(map(str, path_dirs)), "HOME": str(root), **(env or {})}
    return subprocess.run(argv, env=env, capture_output=True, timeout=TIMEOUT, cwd=root)


def _bin(tmp_path: Path, vllm_code: str) -> Path:
    """The vLLM image's PATH: a bare `python3` (the base interpreter, no site-packages of
    ours) and `vllm`."""
    bin_ = tmp_path / "image-bin"
    bin_.mkdir()
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    (bin_ / "python3").symlink_to(base)
    vllm = bin_ / "vllm"
    vllm.write_text("#!" + str(bin_ / "python3") + "\n" + textwrap.dedent(vllm_code))
    vllm.chmod(0o755)
    return bin_


def _play(tmp_path: Path, built_bundle: Path,
          vllm_code: str) -> tuple[dict, subprocess.CompletedProcess]:
    """Render rank 0 of a stock vLLM group, run its init container and its engine container
    (one root: the shared emptyDir is the same directory in both); return the pod as the API
    server reports it once the engine container ended, and that container's run."""
    ref, spec = parse(VLLM.obj())
    pod = render.engine_pod(ref, spec, 0, 0)
    root = tmp_path / "pod"
    for d in (sv.MOUNT, os.path.dirname(DEFAULT_PATH)):  # the volume's mount, /dev
        (root / d.lstrip("/")).mkdir(parents=True)
    in_image = Path(_local(root, sv.BUNDLE_IN_IMAGE))
    in_image.parent.mkdir(parents=True)
    shutil.copy(built_bundle, in_image)
    system = [Path("/usr/bin"), Path("/bin")]
    (install,) = pod["spec"]["initContainers"]
    cp = _run(install, root, system)
    assert cp.returncode == 0, cp.stderr.decode()
    shutil.rmtree(in_image.parent)  # the router image's file is not in the vLLM image

    (c,) = pod["spec"]["containers"]
    assert c["terminationMessagePath"] == DEFAULT_PATH
    message_file = Path(_local(root, DEFAULT_PATH))
    message_file.write_text("")  # the kubelet creates it, empty
    env = {e["name"]: _local(root, e["value"]) for e in c["env"] if "value" in e}
    env |= {"POD_NAME": pod["metadata"]["name"], "POD_NAMESPACE": "ns", "NODE_NAME": "node-a"}
    done = _run(c, root, [_bin(tmp_path, vllm_code), *system], env)
    text = message_file.read_text()
    if not text and c["terminationMessagePolicy"] == "FallbackToLogsOnError":
        text = (done.stdout + done.stderr).decode()[-2048:]
    pod["metadata"] |= {"uid": "uid-g0-r0", "creationTimestamp": "2026-12-02T09:50:00Z"}
    pod["spec"]["nodeName"] = "node-a"
    terminated = {"exitCode": done.returncode, "reason": "Error" if done.returncode else
                  "Completed", "message": text, "finishedAt": "2026-12-02T09:59:58Z"}
    pod["status"] = {"phase": "Failed" if done.returncode else "Succeeded", "containerStatuses": [
        {"name": L.ENGINE_CONTAINER, "state": {"terminated": terminated}}]}
    return pod, done


def _next(pod: dict):
    ref, spec = parse(VLLM.obj())
    memory = Memory(groups={0: {"index": 0, "phase": "Ready", "restarts": 0,
                                "revision": spec.revision}})
    return plan(spec, Observed(ref=ref, pods={0: {0: pod}}), memory, NOW)


def test_a_killed_engine_core_is_named_and_the_group_restarted(tmp_path, built_bundle):
    pod, done = _play(tmp_path, built_bundle, KILLS_ENGINE_CORE)
    assert done.returncode == 1, done.stderr.decode()  # never 0 when vLLM ended unasked
    f = failure_of(pod)
    assert (f.cause, f.permanent, f.process) == ("signaled", False, "EngineCore_DP0")
    assert "EngineCore_DP0" in f.message and "SIGKILL" in f.message, f.message
    got = _next(pod)
    assert got.groups[0]["phase"] == "BackingOff"
    assert got.last_failure["process"] == "EngineCore_DP0"


def test_vllms_own_refusal_is_permanent_with_its_words(tmp_path, built_bundle):
    code = REPLAYS.format(data=str(DATA), case="b-max-model-len")
    pod, done = _play(tmp_path, built_bundle, code)
    assert done.returncode == 1
    # The log passes through unchanged (the kubelet's log is vLLM's).
    assert (DATA / "b-max-model-len.err").read_bytes() in done.stderr
    f = failure_of(pod)
    assert (f.cause, f.permanent) == ("config_error", True), f.message
    assert "User-specified max_model_len (100000) is greater than the derived" in f.message
    assert f.process, "the supervisor names the process that refused"
    got = _next(pod)
    assert got.groups[0]["phase"] == "Failed" and got.restart_count == 0
    assert got.last_failure["process"] == f.process
