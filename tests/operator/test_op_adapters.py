"""InferenceAdapter's pure parts: where a source is inside the engine's pods (or why not), what
spec.lora renders, its checks, and the adapter status and Events made of a sync's view."""

from __future__ import annotations

import pytest
import yaml
from shoal.contract import lora
from shoal.operator import crd_adapter, render
from shoal.operator import labels as L
from shoal.operator.adapter_spec import SOURCE_PATTERN, Adapter, engine_path
from shoal.operator.adapter_status import adapter_events, adapter_status
from shoal.operator.adapter_sync import Answer, Probe, View
from shoal.operator.spec import parse
from shoal.operator.validation import spec_problems
from support.builders import engine

PVC_MODEL = engine().set(model="pvc://models/llama")
HOSTPATH = engine().model_volume("/models", {"hostPath": {"path": "/srv/models"}})
CLAIM_VOLUME = engine().model_volume("/weights", {"persistentVolumeClaim": {"claimName": "w"}})


def adapter(source: str, name: str = "sql", status: dict | None = None) -> Adapter:
    return Adapter.of({"metadata": {"name": name, "namespace": "ns", "uid": "u1",
                                    "generation": 3},
                       "spec": {"engine": "llm", "source": source},
                       "status": status or {}})


@pytest.mark.parametrize("spec, source, path, why", [
    (HOSTPATH, "/models/adapters/sql", "/models/adapters/sql", ""),
    (HOSTPATH, "/models/adapters/sql/", "/models/adapters/sql", ""),
    (PVC_MODEL, "pvc://models/adapters/sql", "/mnt/models/adapters/sql", ""),
    (CLAIM_VOLUME, "pvc://w/a/b", "/weights/a/b", ""),
    (HOSTPATH, "pvc://other/sql", None, "the claim 'other' is not mounted in the pods of "
     "InferenceEngine 'llm' (mounted claims: none)"),
    (PVC_MODEL, "pvc://other/sql", None, "(mounted claims: models)"),
    (HOSTPATH, "relative/sql", None, "is not an absolute path or pvc://CLAIM/PATH"),
    (HOSTPATH, "/models/../etc", None, "is not an absolute path"),
    (HOSTPATH, "hf://org/sql", "org/sql", ""),
    (HOSTPATH, "hf://org/sql@v2", None, "is not an absolute path"),
    (HOSTPATH, "oci://registry/sql", None, "is not an absolute path"),
])
def test_where_a_source_is_inside_the_engine_pods(spec, source, path, why):
    got, problem = engine_path(adapter(source), parse(spec.obj())[1])
    assert got == path
    assert (why in problem) if why else problem == ""


def test_the_crd_pattern_is_the_one_the_operator_checks():
    schema = yaml.safe_load(yaml.safe_dump(crd_adapter.crd()))
    spec = schema["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["source"]["pattern"] == SOURCE_PATTERN
    assert spec["required"] == ["engine", "source"]


def test_spec_lora_gives_every_rank_vllms_flags_and_rank_0_runtime_loading():
    ref, spec = parse(engine().ranks(2).set(lora={"maxLoras": 4, "maxCpuLoras": 8}).obj())
    for rank in (0, 1):
        pod = render.engine_pod(ref, spec, 0, rank)
        (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
        args = c["args"]
        i = args.index("--enable-lora")
        assert args[i:i + 7] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
                                 "--max-cpu-loras", "8"]
        assert {"name": lora.RUNTIME_UPDATES_ENV, "value": "true"} in c["env"]
        assert {"name": "HF_HUB_OFFLINE", "value": "0"} in c["env"]  # hf:// adapters
    ref, hf = parse(engine().set(model="hf://org/llm", lora={}).obj())
    (c,) = [c for c in render.engine_pod(ref, hf, 0, 0)["spec"]["containers"]
            if c["name"] == "engine"]
    assert [e["value"] for e in c["env"] if e["name"] == "HF_HUB_OFFLINE"] == ["1"]
    ref, plain = parse(engine().obj())
    (c,) = [c for c in render.engine_pod(ref, plain, 0, 0)["spec"]["containers"]
            if c["name"] == "engine"]
    assert "--enable-lora" not in c["args"]
    assert all(e["name"] != lora.RUNTIME_UPDATES_ENV for e in c["env"])


def test_adding_spec_lora_is_a_new_revision_and_no_lora_keeps_the_old_one():
    before = parse(engine().obj())[1].revision
    assert parse(engine().set(lora={}).obj())[1].revision != before
    assert parse(engine().set(lora=None).obj())[1].revision == before


@pytest.mark.parametrize("lora_spec, extra, problem", [
    ({"maxLoras": 4, "maxCpuLoras": 2}, [], "spec.lora.maxCpuLoras (2) must be >= maxLoras (4)"),
    ({}, ["--max-loras=2"], "spec.engine.extraArgs sets --max-loras"),
    ({}, ["--lora-modules", "a=/x"], None),
    ({"tp": 2}, [], "the Shoal engine serves adapters without tensor parallelism only"),
    (None, ["--enable-lora"], None),
])
def test_lora_checks(lora_spec, extra, problem):
    tp = (lora_spec or {}).pop("tp", 1)
    body = engine().ranks(1, tp=tp).engine(extraArgs=extra).set(lora=lora_spec).obj()
    got = spec_problems("llm", parse(body)[1])
    assert any(problem in p for p in got) if problem else got == []


NOW = "2026-12-02T10:00:00Z"
OK = Probe(True, "a completion through the frontend Service succeeded", frozenset({0, 1}), 1.0)


def _answer(status: int, message: str, at: float = 5.0) -> Answer:
    return Answer(False, status, message, "/models/a", at)


@pytest.mark.parametrize("name, problem, serving, view, phase, loaded, ready, reason", [
    ("no engine", "InferenceEngine 'llm' not found", [], View(), "Pending", False, False,
     "Waiting"),
    ("no group yet", "", [], View(), "Pending", False, False, "NoGroupReady"),
    ("on every group, probed", "", [0, 1],
     View(loaded={0: frozenset({"sql"}), 1: frozenset({"sql"})}, probes={"sql": OK}),
     "Ready", True, True, "LoadedOnEveryGroup"),
    ("on every group, probe refused", "", [0],
     View(loaded={0: frozenset({"sql"})},
          probes={"sql": Probe(False, "answered 404: no such model", frozenset({0}), 1.0)}),
     "Loading", True, False, "LoadedOnEveryGroup"),
    ("on one of two, the other's path missing", "", [0, 1],
     View(loaded={0: frozenset({"sql"}), 1: frozenset()},
          answers={("sql", 1): _answer(404, "the path '/models/a' does not exist")},
          probes={"sql": OK}),
     "Loading", False, True, "Loading"),
    ("probed on a group that is gone: not Ready until probed again", "", [1],
     View(loaded={1: frozenset({"sql"})},
          probes={"sql": Probe(True, "ok", frozenset({0}), 1.0)}),
     "Loading", True, False, "LoadedOnEveryGroup"),
    ("refused for good everywhere", "", [0],
     View(loaded={0: frozenset()},
          answers={("sql", 0): _answer(400, "rank 64 is above --max-lora-rank 16")}),
     "Failed", False, False, "AdapterInvalid"),
])
def test_adapter_status(name, problem, serving, view, phase, loaded, ready, reason):
    st = adapter_status(adapter("/models/a"), problem=problem, path="/models/a",
                        serving=serving, view=view, now=NOW)
    assert st["phase"] == phase and st["observedGeneration"] == 3
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Loaded"]["status"] == ("True" if loaded else "False")
    assert conds["Ready"]["status"] == ("True" if ready else "False")
    assert conds["Loaded"]["reason"] == reason
    n = len(serving)
    assert st["loaded"] == f"{len(st['loadedGroups'])}/{n}"
    if problem:
        assert problem in conds["Loaded"]["message"] and problem in conds["Ready"]["message"]


def test_the_last_error_names_group_reason_and_the_engines_words_and_outlives_a_fix():
    failing = View(loaded={0: frozenset()},
                   answers={("sql", 0): _answer(400, "rank 64 is above --max-lora-rank 16")})
    st = adapter_status(adapter("/models/a"), problem="", path="/models/a", serving=[0],
                        view=failing, now=NOW)
    assert st["lastError"] == {"group": 0, "reason": "AdapterInvalid", "permanent": True,
                               "message": "rank 64 is above --max-lora-rank 16",
                               "time": "1970-01-01T00:00:05Z"}
    fixed = adapter_status(adapter("/models/a", status=st), problem="", path="/models/a",
                           serving=[0], view=View(loaded={0: frozenset({"sql"})}), now=NOW)
    assert fixed["lastError"] == st["lastError"] and fixed["phase"] == "Loading"


def test_events_say_each_new_fact_once():
    loading = {"phase": "Loading", "loadedGroups": [0], "path": "/models/a"}
    ready = {"phase": "Ready", "loadedGroups": [0, 1], "path": "/models/a",
             "conditions": [{"type": "Ready", "message": "served"}]}
    assert adapter_events({}, loading) == [("Normal", "Loaded", "loaded on group 0 from "
                                            "/models/a")]
    assert adapter_events(loading, ready) == [
        ("Normal", "Loaded", "loaded on group 1 from /models/a"), ("Normal", "Ready", "served")]
    assert adapter_events(ready, ready) == []
    err = {**loading, "lastError": {"group": 1, "message": "does not exist"}}
    assert adapter_events(loading, err) == [("Warning", "LoadFailed", "group 1: does not exist")]


def test_a_restarted_group_has_nothing_its_old_pod_had():
    view = View(loaded={0: frozenset({"sql"}), 1: frozenset({"sql"})},
                answers={("bad", 0): _answer(400, "rank"), ("bad", 1): _answer(400, "rank")},
                urls={0: "http://10.0.0.1:8000", 1: "http://10.0.0.2:8000"})
    now = view.of({0: "http://10.0.0.1:8000", 1: "http://10.0.0.9:8000"})  # group 1: new pod
    assert now.has(0, "sql") and now.answered(0, "bad")
    assert not now.has(1, "sql") and not now.answered(1, "sql") and not now.answered(1, "bad")


def test_a_group_whose_list_did_not_answer_is_held_for_a_while_only():
    from shoal.operator.adapter_sync import NO_LIST_HOLD_SECONDS

    silent = Answer(False, 0, "group 0: did not answer", "/models/a", 100.0, unlisted=True)
    view = View(loaded={0: None}, answers={("sql", 0): silent})
    assert not view.answered(0, "sql", now=100.0 + NO_LIST_HOLD_SECONDS - 1)
    assert view.answered(0, "sql", now=100.0 + NO_LIST_HOLD_SECONDS)
    refused = View(answers={("sql", 0): _answer(404, "does not exist")})
    assert refused.answered(0, "sql", now=0.0)  # an engine's answer releases at once


def test_frontend_urls_are_the_ready_frontend_pods_own_addresses():
    """An adapter's delete asks each Ready frontend pod (not the Service) whether it still
    lists the adapter: the rendered frontend pod, as Running and Ready or not."""
    from shoal.operator.observed import frontend_urls
    from shoal.operator.spec import EngineRef

    ref = EngineRef("llm", "ns", "u1")
    template = render.frontend_deployment(ref, parse(engine().obj())[1])["spec"]["template"]

    def pod(ip: str, ready: bool) -> dict:
        return {**template, "status": {"phase": "Running", "podIP": ip, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]}}

    assert frontend_urls([pod("10.1.0.5", True), pod("10.1.0.6", False),
                          pod("fd00::7", True), {**template, "status": {"phase": "Pending"}}]
                         ) == [f"http://10.1.0.5:{L.HTTP_PORT}", f"http://[fd00::7]:{L.HTTP_PORT}"]
