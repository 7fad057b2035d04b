"""The operator's pure path over specs drawn from the CRD's own schema (issue 29, item 5; the
API-server tier is test_op_fuzz_k8s.py): spec.parse, validation.spec_problems, render and
plan.plan with nothing observed raise nothing for any spec the schema admits; every problem
names a field; an invalid spec creates nothing, a valid one creates every group, each child
owned by the resource; status is JSON. The autoscaler's decision holds for whatever numbers
the engines report.

Drawn derandomized, without an example database: the same cases for the same selection of
tests (hypothesis also draws constants of the local modules loaded, so another selection may
draw others; the k8s tier draws in a fresh interpreter for counts that never move).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from functools import cache

import jsonschema
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from shoal.operator import autoscale, render
from shoal.operator.actions import ApplyChildren, CreatePods
from shoal.operator.autoscale_metrics import Sample
from shoal.operator.plan import Memory, Observed, plan
from shoal.operator.spec import AutoscalingSpec, parse
from shoal.operator.status import engine_status
from shoal.operator.validation import spec_problems
from support import spec_fuzz
from support.spec_mutations import mutations

T0 = dt.datetime(2026, 12, 4, 12, 0, 0, tzinfo=dt.timezone.utc)
NAMES_A_FIELD = re.compile(r"\b(spec|metadata)\.[A-Za-z]")
FUZZ = settings(max_examples=60, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))


@cache
def schema() -> dict:
    """The CRD's spec schema, read when a test first draws (collecting this file stays cheap)."""
    return spec_fuzz.spec_schema(spec_fuzz.installed_crd())


def _body(spec: dict, name: str = "llm") -> dict:
    return {"apiVersion": "shoal.dev/v1alpha1", "kind": "InferenceEngine",
            "metadata": {"name": name, "namespace": "ns", "uid": "uid-1", "generation": 1},
            "spec": spec}


def judged_or_rendered(body: dict) -> None:
    """The pass over a body nothing was created for yet, checked."""
    ref, spec = parse(body)
    problems = spec_problems(ref.name, spec)
    for problem in problems:
        assert NAMES_A_FIELD.search(problem), f"a problem that names no field: {problem}"
    p = plan(spec, Observed(ref=ref, generation=1), Memory(), T0)
    created = {a.group for a in p.actions if isinstance(a, CreatePods)}
    if problems:
        assert not any(isinstance(a, (ApplyChildren, CreatePods)) for a in p.actions)
        assert list(p.problems) == problems
    else:
        assert any(isinstance(a, ApplyChildren) for a in p.actions)
        assert created == set(range(p.replicas))
        children = render.render_children(ref, spec)
        assert all(c["metadata"]["ownerReferences"] == [ref.owner_reference()]
                   for c in children)
        assert sum(c["kind"] == "Pod" for c in children) == spec.replicas * spec.nodes_per_group
    status = engine_status(ref=ref, generation=1, deleting=False, plan=p, frontends_ready=0,
                           frontends_desired=spec.frontend_replicas, pods_left=0, previous=[],
                           now="2026-12-04T12:00:00Z")
    json.dumps(status, allow_nan=False)  # what the status patch sends


@FUZZ
@given(st.deferred(lambda: spec_fuzz.specs(schema())))
def test_every_spec_the_schema_admits_is_judged_or_rendered(spec):
    judged_or_rendered(_body(spec))


def test_every_mutation_the_schema_admits_is_judged_or_rendered():
    """The mutations a 1.20 server takes (huge and odd strings, map keys, names), so the
    operator sees them; those it refuses are test_op_fuzz_k8s.py's."""
    check = jsonschema.Draft7Validator(spec_fuzz.drawable(schema(), bounds={}))
    admitted = [c for c in mutations(schema()) if check.is_valid(c.spec)]
    assert len(admitted) > 100  # not vacuous: 166 at the CRD of 2026-12-04
    failed = []
    for case in admitted:
        try:
            judged_or_rendered(_body(case.spec, case.name or "llm"))
        except Exception as e:  # noqa: BLE001 - every failing case is named below
            failed.append(f"{case.label}: {type(e).__name__}: {str(e)[:300]}")
    assert not failed, "\n".join(failed)


_NUMBER = st.floats(min_value=0) | st.just(float("nan"))  # /metrics may say NaN, +Inf


@FUZZ
@given(st.deferred(lambda: spec_fuzz.specs(schema()["properties"]["autoscaling"], bounds={})),
       st.lists(st.tuples(_NUMBER, _NUMBER, _NUMBER), min_size=1, max_size=3))
def test_the_autoscaler_decides_for_any_numbers_the_engines_report(auto, loads):
    a = AutoscalingSpec.of({"autoscaling": auto})
    assume(a.min_replicas <= a.max_replicas)  # else SpecValid=False: plan() does not decide
    samples = {g: Sample(running, waiting, kv) for g, (running, waiting, kv) in enumerate(loads)}
    d = autoscale.decide(a, replicas=len(loads), ready=set(samples), samples=samples,
                         memory={"desiredGroups": len(loads)}, wake=None, now=T0)
    assert a.min_replicas <= d.desired <= a.max_replicas or d.desired == len(loads)
    json.dumps(d.memory, allow_nan=False)  # status.autoscaling
