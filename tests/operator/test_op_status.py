"""status.summarize: Ready means served (groups Ready *and* a frontend Ready with a group in its
discovery list); a resource being deleted says Terminating, never "0/0 ready"."""

from __future__ import annotations

from shoal.operator.status import summarize


def _summary(**kw):
    args = dict(
        replicas=2,
        groups=[{"index": 0, "phase": "Ready"}, {"index": 1, "phase": "Ready"}],
        problems=[],
        deleting=False,
        last_failure=None,
        generation=1,
        now="2026-11-30T00:00:00Z",
        previous=[],
        frontends_ready=1,
        frontends_desired=1,
        serving=[0, 1],
        pods_left=2,
    )
    args.update(kw)
    phase, conds = summarize(**args)
    return phase, {c["type"]: c for c in conds}


def test_ready_needs_every_group_and_a_serving_frontend():
    phase, c = _summary()
    assert phase == "Ready" and c["Ready"]["status"] == "True" and c["Serving"]["status"] == "True"
    assert c["Serving"]["message"] == "1/1 frontends ready; discovery lists groups 0, 1"


def test_groups_ready_without_a_ready_frontend_is_not_ready():
    phase, c = _summary(frontends_ready=0)
    assert phase == "Progressing"
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "FrontendsNotReady")
    assert (c["Serving"]["status"], c["Serving"]["reason"]) == ("False", "NoFrontendReady")


def test_a_ready_frontend_with_an_empty_discovery_list_does_not_serve():
    phase, c = _summary(
        groups=[{"index": 0, "phase": "Starting"}, {"index": 1, "phase": "Starting"}], serving=[]
    )
    assert phase == "Progressing" and c["Serving"]["reason"] == "NoGroupInDiscovery"
    assert c["Ready"]["reason"] == "GroupsNotReady"


def test_deleting_says_terminating_and_what_is_left():
    phase, c = _summary(replicas=0, deleting=True, groups=[{"index": 0, "phase": "Draining"}],
                        frontends_ready=0, serving=[], pods_left=3)
    assert phase == "Terminating"
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "Terminating")
    assert c["Ready"]["message"] == "deleting: 1 groups stopping, 3 engine pods left"
    assert c["Serving"]["reason"] == "Terminating"


def test_scaled_to_zero_is_not_ready():
    phase, c = _summary(replicas=0, groups=[], serving=[], frontends_ready=1)
    assert c["Ready"]["reason"] == "ScaledToZero" and c["Ready"]["status"] == "False"


def test_engine_dead_names_the_process_the_supervisor_named():
    lf = {"group": 0, "rank": 0, "pod": "llm-g0-r0", "exitCode": 1, "cause": "signaled",
          "permanent": False, "message": "EngineCore_DP0 (pid 312, rank 0) killed by SIGKILL (9)",
          "process": "EngineCore_DP0"}
    groups = [{"index": 0, "phase": "BackingOff", "message": "rank 0 (EngineCore_DP0) died"},
              {"index": 1, "phase": "Ready"}]
    _, c = _summary(groups=groups, last_failure=lf)
    dead = c["EngineDead"]
    assert (dead["status"], dead["reason"]) == ("True", "Signaled")
    assert dead["message"].startswith("group 0 rank 0 pod llm-g0-r0 process EngineCore_DP0 "
                                      "(signaled, exit code 1): EngineCore_DP0 (pid 312")
    _, c = _summary(groups=groups, last_failure={k: v for k, v in lf.items() if k != "process"})
    assert c["EngineDead"]["message"].startswith("group 0 rank 0 pod llm-g0-r0 (signaled")
