"""Stock vLLM groups (`runtime: VLLM`) on real pods, with the vLLM image built here
(images/vllm-cpu, the `vllm_image` fixture) and Shoal's supervisor injected by the operator:
completion and stream through the Service; kill -9 of `VLLM::EngineCore` or of its `VLLM::Worker`
under streams is named in status (the process, its pid, SIGKILL), the group restarts and serves
again; a flag value vLLM refuses at config time is reported with vLLM's own message and not
restarted; delete with streams in flight drains with vLLM's `--shutdown-timeout`."""

from __future__ import annotations

import json
import time

import pytest
from support.wait import wait_for

from e2e.e2e_helpers import (
    MODEL,
    Stream,
    client,
    create,
    events,
    pods,
    record,
    service_url,
    status,
    wait_ready,
    wait_serving,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
NAME = "vllm"
# vLLM on CPU: the API server, the EngineCore and the worker hold about 3 GB together
# (docs/cluster.md); the KV cache space is vLLM's own CPU knob, in GiB.
VLLM_ENV = [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}]
RESOURCES = {"requests": {"cpu": "100m", "memory": "1Gi"}, "limits": {"memory": "6Gi"}}


def create_vllm(cluster, ns: str, name: str, image: str, extra_args=(), shutdown_s: int = 60,
                **kw) -> dict:
    # --enforce-eager: start-up 40 s instead of 63 s on this machine (measured; three start-ups
    # per run). vLLM's inductor path is run by the supervisor's host tests (tests/supervisor).
    return create(cluster, ns, name, runtime="VLLM", image=image, shutdown_s=shutdown_s,
                  extra_args=["--enforce-eager", *extra_args],
                  engine_overrides={"env": VLLM_ENV, "resources": RESOURCES,
                                    "startupTimeoutSeconds": 600}, **kw)


@pytest.fixture(scope="module")
def served(cluster, vllm_image):
    ns = cluster.new_namespace("e2e-vllm")
    t0 = time.monotonic()
    create_vllm(cluster, ns, NAME, vllm_image, backoff_base=2)
    wait_ready(cluster, ns, NAME, "1/1", timeout=600)
    url = service_url(cluster, ns, NAME)
    wait_serving(url)
    record("vllm_apply_to_serving", time.monotonic() - t0)
    yield {"ns": ns, "url": url, "image": vllm_image}
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_vllm_group_serves_completion_and_stream_through_the_service(cluster, served):
    ns, url = served["ns"], served["url"]
    (pod,) = pods(cluster, ns, f"shoal.dev/engine={NAME},shoal.dev/component=engine")
    engine = pod["spec"]["containers"][0]
    # The image is the stock one; the supervisor runs vLLM with the image's own python3.
    assert engine["image"] == served["image"]
    assert engine["command"][:3] == ["python3", "/shoal-supervisor/shoal-supervisor.pyz", "--"]
    assert engine["command"][3:] + engine["args"][:1] == ["vllm", "serve"]
    oai = client(url)
    assert [m.id for m in oai.models.list().data] == [MODEL]
    out = oai.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=12,
                                 temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 12
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    # The log flows through the supervisor unchanged: vLLM's own start-up lines are there.
    log = cluster.kubectl("logs", "-n", ns, pod["metadata"]["name"], "-c", "engine",
                          timeout=30).stdout + cluster.kubectl(
        "logs", "-n", ns, pod["metadata"]["name"], "-c", "engine", timeout=30).stderr
    assert "Application startup complete" in log or "Starting vLLM" in log, log[-3000:]


def _kill_named_and_recovered(cluster, served, title: str, process: str) -> dict:
    """kill -9 of the vLLM process titled `title` in rank 0 under two streams: the supervisor's
    message names `process`, its pid and SIGKILL; the group restarts and serves again."""
    ns, url = served["ns"], served["url"]
    wait_ready(cluster, ns, NAME, "1/1", timeout=600)
    pod = f"{NAME}-g0-r0"
    old_uid = cluster.get("pod", pod, "-n", ns)["metadata"]["uid"]
    restarts_before = status(cluster, ns, NAME).get("restartCount", 0)
    streams = [Stream(url, max_tokens=900) for _ in range(2)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started_tokens.wait(120) and s.error is None, s.error
    kill = ("import os, signal\n"
            "pids = [int(p) for p in os.listdir('/proc') if p.isdigit()"
            f" and open(f'/proc/{{p}}/cmdline', 'rb').read().startswith(b'{title}')]\n"
            f"assert pids, 'no {title} process'\n"
            "[os.kill(p, signal.SIGKILL) for p in pids]\nprint(pids)\n")
    killed = cluster.kubectl("exec", "-n", ns, pod, "-c", "engine", "--", "python3", "-c",
                             kill).stdout.strip()
    t_kill = time.monotonic()

    def failure_recorded():
        lf = status(cluster, ns, NAME).get("lastFailure") or {}
        return lf if lf.get("pod") == pod and lf.get("time") and \
            lf.get("time") != served.get("last_failure_time") else None

    lf = wait_for(failure_recorded, timeout=120, interval=0.5, what="status.lastFailure")
    served["last_failure_time"] = lf["time"]
    print(f"lastFailure after kill -9 of {title}: {lf}")
    # The supervisor's message, through the real kubelet: the process, its pid and the signal.
    assert lf["group"] == 0 and lf["rank"] == 0 and lf["permanent"] is False, lf
    assert lf.get("process", "").startswith(process), lf
    (pid,) = json.loads(killed)
    assert lf["message"].startswith(f"{lf['process']} (pid {pid}, rank 0) killed by SIGKILL"), \
        (lf, killed)
    assert lf["exitCode"] != 0, lf  # vLLM itself exits 0 after its EngineCore died
    for s in streams:
        s.join(120)
        assert not s.is_alive(), f"a stream hung after {title} was killed"
    died = wait_for(lambda: [e for e in events(cluster, ns, "EngineDied")
                             if f"process {process} " in e["message"]], timeout=30,
                   what="EngineDied")
    assert f"process {lf['process']}" in died[-1]["message"], died[-1]
    wait_for(lambda: cluster.get("pod", pod, "-n", ns)["metadata"]["uid"] != old_uid,
             timeout=120, interval=0.5, what="rank 0 recreated", ignore=(AssertionError,))
    wait_serving(url, timeout=600)
    record(f"vllm_kill_{process.lower()}_to_serving", time.monotonic() - t_kill)
    st = wait_ready(cluster, ns, NAME, "1/1", timeout=600)
    assert st["restartCount"] == restarts_before + 1
    return lf


def test_kill9_of_vllm_engine_core_is_named_and_the_group_serves_again(cluster, served):
    lf = _kill_named_and_recovered(cluster, served, "VLLM::EngineCore", "EngineCore")
    assert lf["cause"] == "signaled", lf


def test_kill9_of_a_vllm_worker_is_named_and_the_group_serves_again(cluster, served):
    _kill_named_and_recovered(cluster, served, "VLLM::Worker", "Worker")


def test_delete_with_streams_in_flight_drains_with_vllm_shutdown_timeout(cluster, served):
    ns, url = served["ns"], served["url"]
    wait_ready(cluster, ns, NAME, "1/1", timeout=600)
    wait_serving(url)
    (pod,) = pods(cluster, ns, f"shoal.dev/engine={NAME},shoal.dev/component=engine")
    assert "--shutdown-timeout" in pod["spec"]["containers"][0]["args"]
    streams = [Stream(url, max_tokens=500) for _ in range(2)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started_tokens.wait(120) and s.error is None, s.error
    cluster.kubectl("delete", "ie", NAME, "-n", ns, "--wait=false")
    t_delete = time.monotonic()
    for s in streams:
        s.join(300)
    assert [s.finish_reason for s in streams] == ["length"] * 2, \
        [(s.finish_reason, s.error, s.chunks) for s in streams]
    wait_for(lambda: events(cluster, ns, "DrainFinished", NAME), timeout=120,
             what="DrainFinished")
    assert len(events(cluster, ns, "DrainStarted", NAME)) == 1
    wait_for(lambda: not pods(cluster, ns, f"shoal.dev/engine={NAME}"), timeout=180,
             what="every pod gone")
    record("vllm_delete_drain", time.monotonic() - t_delete, streams=2)


def test_vllm_config_error_is_named_with_vllms_words_and_not_restarted(cluster, new_ns,
                                                                       vllm_image):
    ns = new_ns("e2e-vllm-perm")
    name = "vllm-perm"
    # Above the model's max_position_embeddings (2048): vLLM refuses it when it builds its config.
    create_vllm(cluster, ns, name, vllm_image, extra_args=["--max-model-len", "100000"],
                backoff_base=1)

    def failed():
        st = status(cluster, ns, name)
        return st if st.get("phase") == "Failed" and st.get("lastFailure") else None

    st = wait_for(failed, timeout=300, interval=1, what="phase Failed with lastFailure")
    lf = st["lastFailure"]
    assert (lf["rank"], lf["cause"], lf["permanent"]) == (0, "config_error", True), lf
    assert "max_model_len (100000) is greater than the derived max_model_len" in lf["message"], lf
    assert wait_for(lambda: events(cluster, ns, "RestartSkipped"), timeout=30,
                    what="RestartSkipped")
    time.sleep(5)  # a later pass must not restart it either
    assert status(cluster, ns, name).get("restartCount", 0) == 0
