"""Fuzzed InferenceEngines (issue 29, item 5) against the real API server, the real CRD and the
real operator process: specs drawn from the CRD's openAPIV3Schema as the server serves it
(support/spec_fuzz.py) and mutations outside it (support/spec_mutations.py), each created once.

Every case ends one of three ways (support/fuzz_outcomes.py): refused at apply with a 422 that
names the field; accepted and reported SpecValid=False naming the field; or served (SpecValid
True and every child the operator renders created, owned by the resource). For every batch: the
operator is still running, its log has no traceback, and no object in the namespace lacks an
owner chain to an InferenceEngine. The count per outcome is printed (and kept in
docs/operator.md).

Cases go in batches of BATCH accepted resources per namespace, so that one wait covers the
operator's passes for all of them, the mutations first while a fresh interpreter draws the
specs; the drawing is deterministic (a pinned hypothesis, derandomized, no module of the
session's in the drawing interpreter), so CI sees the same cases every run.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from kubernetes.client.exceptions import ApiException
from shoal.operator import labels as L
from support import spec_fuzz
from support.engine_api import create_ie
from support.fuzz_outcomes import (
    CHILD_KINDS,
    Outcome,
    Result,
    orphans,
    rejected,
    settle,
    spec_valid,
)
from support.spec_mutations import Case, mutations
from support.wait import WaitTimeout, wait_for

pytestmark = pytest.mark.k8s

DRAWN = 200  # specs drawn from the schema (duplicates dropped), while the mutations run
BATCH = 60  # accepted resources per namespace and wait
WRITERS = 8  # requests in flight while creating and removing a batch
SETTLE_SECONDS = 120  # for the operator's passes over one batch, on a loaded 2-core machine
PRIORITY_CLASS = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                  "metadata": {"name": "fuzz-high"}, "value": 1000}  # the bases' templates use it


class Cases:
    """The mutations at once, the drawn specs when their interpreter is done (it draws while
    the mutations are created)."""

    def __init__(self, kube):
        schema = spec_fuzz.spec_schema(spec_fuzz.installed_crd(kube))
        self.drawing = spec_fuzz.DrawnSpecs(schema, DRAWN)
        self.todo = list(enumerate(mutations(schema)))
        self.total = len(self.todo)

    def take(self, n: int) -> list[tuple[int, Case]]:
        if not self.todo and self.drawing is not None:
            drawn = self.drawing.result()
            self.drawing = None
            self.todo = [(self.total + i, Case(f"drawn #{i}", s)) for i, s in enumerate(drawn)]
            self.total += len(drawn)
        out, self.todo = self.todo[:n], self.todo[n:]
        return out

    def __bool__(self) -> bool:
        return bool(self.todo) or self.drawing is not None

    def close(self) -> None:
        if self.drawing is not None:
            self.drawing.close()


def _body(case: Case, name: str, ns: str) -> dict:
    return {"apiVersion": L.API_VERSION, "kind": L.KIND,
            "metadata": {"name": case.name or name, "namespace": ns}, "spec": case.spec}


def _children(kube, ns: str, pdb: str | None) -> list[dict]:
    kinds = dict(CHILD_KINDS)
    if pdb:
        kinds["PodDisruptionBudget"] = (pdb, "poddisruptionbudgets")
    out = []
    for kind, (api_version, plural) in kinds.items():
        out += [{**o, "kind": kind} for o in kube.list(api_version, plural, ns)]
    return out


def _owned(children: list[dict]) -> dict[tuple[str, str], str]:
    return {(o["kind"], o["metadata"]["name"]): ref["uid"] for o in children
            for ref in o["metadata"].get("ownerReferences") or [] if ref.get("kind") == L.KIND}


class Batch:
    """One namespace of cases: created (WRITERS at a time: each create waits on etcd), then
    waited for together, checked and removed."""

    def __init__(self, kube, ns: str, pdb: str | None):
        self.kube, self.ns, self.pdb = kube, ns, pdb
        self.pending: dict[str, Result] = {}
        self.done: list[Result] = []

    def create(self, cases: list[tuple[int, Case]]) -> None:
        with ThreadPoolExecutor(WRITERS) as pool:
            for result, error in pool.map(self._create, cases):
                if error is None:
                    self.pending[result.name] = result
                else:
                    self.done.append(rejected(result, error.status, error.body or ""))

    def _create(self, item: tuple[int, Case]) -> tuple[Result, ApiException | None]:
        i, case = item
        result = Result(case, case.name or f"f{i:04d}")
        try:
            create_ie(self.kube, _body(case, result.name, self.ns))
        except ApiException as e:
            return result, e
        return result, None

    def settle(self) -> None:
        def step() -> bool:
            engines = {o["metadata"]["name"]: o for o in
                       self.kube.list(L.API_VERSION, L.PLURAL, self.ns)}
            judged = [n for n in self.pending if n in engines and spec_valid(engines[n])]
            owned = _owned(_children(self.kube, self.ns, self.pdb)) if judged else {}
            for name in judged:
                if settle(self.pending[name], engines[name], owned, self.pdb):
                    self.done.append(self.pending.pop(name))
            return not self.pending

        try:
            wait_for(step, timeout=SETTLE_SECONDS, interval=1.0,
                     what=f"the operator to judge {len(self.pending)} resources in {self.ns}")
        except WaitTimeout:
            for result in self.pending.values():
                ie = self.kube.get(L.API_VERSION, L.PLURAL, self.ns, result.name) or {}
                result.problem = (f"neither SpecValid=False nor served within "
                                  f"{SETTLE_SECONDS}s; status: {ie.get('status')}")
                self.done.append(result)
            self.pending.clear()

    def orphans(self) -> list[str]:
        engines = {o["metadata"]["uid"] for o in self.kube.list(L.API_VERSION, L.PLURAL, self.ns)}
        return orphans(_children(self.kube, self.ns, self.pdb), engines)

    def remove(self) -> None:
        """What cleanup_namespace does, WRITERS at a time: the resources without waiting for
        their ordered stop (no kubelet runs), their engine pods, then the namespace."""
        def engine(obj):
            name = obj["metadata"]["name"]
            self.kube.delete(L.API_VERSION, L.PLURAL, self.ns, name)
            self.kube.patch(L.API_VERSION, L.PLURAL, self.ns, name,
                            {"metadata": {"finalizers": None}})

        def pod(obj):
            self.kube.delete("v1", "pods", self.ns, obj["metadata"]["name"], grace_seconds=0)

        with ThreadPoolExecutor(WRITERS) as pool:
            list(pool.map(engine, self.kube.list(L.API_VERSION, L.PLURAL, self.ns)))
            selector = f"{L.LABEL_COMPONENT}={L.COMPONENT_ENGINE}"
            list(pool.map(pod, self.kube.list("v1", "pods", self.ns, selector)))
        self.kube.delete("v1", "namespaces", None, self.ns)


def _log_since(operator, offset: int) -> tuple[str, int]:
    text = operator.log_path.read_text(errors="replace")
    return text[offset:], len(text)


def _table(results: list[Result], seconds: float) -> str:
    counts = Counter((r.case.field is None, r.outcome) for r in results)
    rows = [f"{'outcome':44} {'drawn':>6} {'mutated':>8} {'all':>6}"]
    for outcome in Outcome:
        d, m = counts[(True, outcome)], counts[(False, outcome)]
        rows.append(f"{outcome.value:44} {d:>6} {m:>8} {d + m:>6}")
    refused = Counter(r.case.field is None for r in results if r.child_refused)
    rows.insert(3, f"{'  of which a child the API server refused':44} {refused[True]:>6} "
                   f"{refused[False]:>8} {refused[True] + refused[False]:>6}")
    drawn = sum(1 for r in results if r.case.field is None)
    rows.append(f"{'cases tried':44} {drawn:>6} {len(results) - drawn:>8} {len(results):>6}")
    rows.append(f"{len(results)} cases in {seconds:.0f} s")
    return "\n".join(rows)


def _checks(batch: Batch, operator, log: str) -> list[str]:
    """What must hold after every batch, broken: a traceback, the operator gone, an orphan."""
    names = ", ".join(f"{r.name}: {r.case.label}" for r in batch.done
                      if r.outcome is not Outcome.REJECTED)
    out = []
    if "Traceback" in log:
        out.append(f"operator traceback in {batch.ns} (cases {names}):\n{log[-6000:]}")
    if operator.proc.poll() is not None:
        out.append(f"the operator exited {operator.proc.returncode}:\n{operator.tail()}")
    elif lost := batch.orphans():
        out.append(f"children without an owning InferenceEngine in {batch.ns}: {lost}")
    return out


def test_fuzzed_specs_are_refused_named_or_served(control_plane, kube, operator, capsys):
    t0 = time.monotonic()
    cases = Cases(kube)
    try:
        kube.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", body=PRIORITY_CLASS)
    except ApiException as e:
        if e.status != 409:  # left by an earlier run of this session: the same object
            raise
    pdb = _pdb_api(kube)
    results: list[Result] = []
    broken: list[str] = []
    offset = 0
    try:
        while cases and operator.proc.poll() is None:
            batch = Batch(kube, control_plane.new_namespace("opt-fuzz"), pdb)
            try:
                while cases and len(batch.pending) < BATCH:
                    batch.create(cases.take(WRITERS * 2))
                batch.settle()
                results += batch.done
                log, offset = _log_since(operator, offset)
                broken += _checks(batch, operator, log)
            finally:
                batch.remove()
            with capsys.disabled():
                print(f"\n{batch.ns}: {len(results)}/{cases.total} cases, "
                      f"{time.monotonic() - t0:.0f} s, "
                      f"{sum(1 for r in batch.done if r.problem)} problems", end="")
    finally:
        cases.close()
        kube.delete("scheduling.k8s.io/v1", "priorityclasses", None, "fuzz-high")
    with capsys.disabled():
        print("\n" + _table(results, time.monotonic() - t0))
    problems = [f"{r.name} ({r.case.label}): {r.problem}" for r in results if r.problem]
    assert not broken and not problems, "\n".join(broken + problems)
    assert len(results) == cases.total and all(r.outcome for r in results)
    drawn_refused = [r.case.spec for r in results
                     if r.case.field is None and r.outcome is Outcome.REJECTED]
    assert not drawn_refused, f"specs drawn from the schema were refused: {drawn_refused}"
    assert {r.outcome for r in results} == set(Outcome), "every outcome should be reached"


def _pdb_api(kube) -> str | None:
    """The PodDisruptionBudget API the operator uses (policy/v1beta1 on the 1.20 server)."""
    for gv in ("policy/v1", "policy/v1beta1"):
        if "poddisruptionbudgets" in kube.resources(gv):
            return gv
    return None
