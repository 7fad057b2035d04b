"""The real `shoal fetch`'s output fed into the operator: its progress lines into the parser the
status reads, and its termination message (a hub that refuses the token) into `failure_of` and
`plan`, as the kubelet would put them in the init container's status. The hub is the stand-in
(tests/support/stand_in_hub.py: no real hub is reachable here); the client and `shoal fetch`
are real. No hand-typed messages."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import threading

import pytest
from shoal.contract import model_fetch as mf
from shoal.operator import labels as L
from shoal.operator.failures import failure_of
from shoal.operator.model_volumes import fetch_container
from shoal.operator.phases import GroupPhase
from shoal.operator.plan import Memory, Observed, plan
from shoal.operator.spec import parse
from support.builders import engine
from support.models import ensure_model
from support.stand_in_hub import make_server

pytestmark = pytest.mark.process
TOKEN = "hf_right"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-root")
    (root / "shoal").mkdir()
    (root / "shoal" / "tiny").symlink_to(ensure_model("shoal-tiny", "tiny"))
    server = make_server(root, "127.0.0.1", 0, token=TOKEN)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _fetch(hub: str, tmp_path, token: str) -> tuple[int, str, str]:
    """`shoal fetch` as the model-fetch container runs it: (exit code, stdout, message)."""
    spec = parse(engine().set(model="hf://shoal/tiny@main").obj())[1]
    command = fetch_container(spec)["command"]
    term = tmp_path / "termination-log"
    term.write_text("")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")}
    env.update(HF_ENDPOINT=hub, HF_TOKEN=token, HF_HOME=str(tmp_path / "home"),
               SHOAL_TERMINATION_LOG=str(term))
    argv = [sys.executable, "-m", "shoal.cli", *command[1:]]
    argv[argv.index(mf.CACHE_DIR)] = str(tmp_path / "cache")  # the cache, here
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, term.read_text()


def _pod(state: dict) -> dict:
    body = engine().set(model="hf://shoal/tiny@main").obj()
    labels = {L.LABEL_GROUP: "0", L.LABEL_RANK: "0", L.LABEL_REVISION: parse(body)[1].revision}
    return {"metadata": {"name": "llm-g0-r0", "uid": "u0", "labels": labels,
                         "creationTimestamp": "2026-12-01T10:00:00Z"},
            "spec": {"nodeName": "n1"},
            "status": {"phase": "Failed",
                       "initContainerStatuses": [{"name": mf.FETCH_CONTAINER, "state": state}],
                       "containerStatuses": [{"name": L.ENGINE_CONTAINER, "state": {
                           "waiting": {"reason": "PodInitializing"}}}]}}


def test_a_refused_token_fails_the_group_for_good_naming_the_repository(hub, tmp_path):
    code, _, message = _fetch(hub, tmp_path, "hf_wrong")
    assert code == 2 and message
    pod = _pod({"terminated": {"exitCode": code, "reason": "Error", "message": message,
                               "finishedAt": "2026-12-01T10:00:05Z"}})
    f = failure_of(pod)
    assert (f.cause, f.permanent) == ("model_access_denied", True), f
    body = engine().set(model="hf://shoal/tiny@main").obj()
    ref, spec = parse(body)
    p = plan(spec, Observed(ref=ref, pods={0: {0: pod}}),
             Memory(groups={0: {"index": 0, "phase": "Starting", "restarts": 0}}),
             dt.datetime(2026, 12, 1, 10, 0, 10, tzinfo=dt.timezone.utc))
    assert p.groups[0]["phase"] == GroupPhase.FAILED
    assert "shoal/tiny" in p.last_failure["message"]


def test_the_fetchers_progress_lines_are_what_the_status_reads(hub, tmp_path):
    code, out, _ = _fetch(hub, tmp_path, TOKEN)
    assert code == 0, out
    progress = mf.parse_progress(out)
    assert progress is not None and progress.repo == "shoal/tiny@main", out
    assert progress.done_gib == progress.total_gib > 0
