"""A permanent fault (a bad flag in engine.extraArgs) is reported from the engine's real
termination message and not restarted; fixing the spec recovers."""

from __future__ import annotations

import json

import pytest
from support.wait import wait_for

from e2e.e2e_helpers import completes, create, events, ie, service_url, status, wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_bad_flag_is_permanent_until_the_spec_is_fixed(cluster, new_ns):
    ns = new_ns("e2e-perm")
    name = "perm"
    create(cluster, ns, name, extra_args=["--no-such-flag"], backoff_base=1)
    pod = f"{name}-g0-r0"

    def failed():
        st = status(cluster, ns, name)
        return st if st.get("phase") == "Failed" and st.get("lastFailure") else None

    st = wait_for(failed, timeout=240, interval=1, what="phase Failed with lastFailure")
    lf = st["lastFailure"]
    assert (lf["pod"], lf["rank"], lf["cause"], lf["permanent"]) == (pod, 0, "config_error", True)
    assert "--no-such-flag" in lf["message"] and lf["exitCode"] == 2, lf
    dead = {c["type"]: c for c in st["conditions"]}["EngineDead"]
    assert dead["status"] == "True" and dead["reason"] == "PermanentError", dead
    skipped = wait_for(lambda: events(cluster, ns, "RestartSkipped"), timeout=30,
                       what="RestartSkipped")
    assert "fix the spec" in skipped[-1]["message"]
    # Not restarted: the failed pod is kept (for its logs) across the operator's later passes.
    uid = cluster.get("pod", pod, "-n", ns)["metadata"]["uid"]
    gen = ie(cluster, ns, name)["metadata"]["generation"]
    cluster.kubectl("annotate", "ie", name, "-n", ns, "e2e/poke=1")  # triggers a pass
    wait_for(lambda: events(cluster, ns, "RestartSkipped") and status(cluster, ns, name)
             .get("observedGeneration") == gen, timeout=30, what="a later pass")
    assert cluster.get("pod", pod, "-n", ns)["metadata"]["uid"] == uid
    assert status(cluster, ns, name).get("restartCount", 0) == 0

    extra = ["--max-model-len", "1024", "--max-num-seqs", "16"]
    cluster.kubectl("patch", "ie", name, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"engine": {"extraArgs": extra}}}))
    wait_ready(cluster, ns, name, "1/1")
    url = service_url(cluster, ns, name)
    wait_for(lambda: completes(url), timeout=120, interval=0.5, what="serving after the fix")
