"""The Helm chart: lint, render with every example values file, validate the output against the
Kubernetes schemas, and check what the chart promises (RBAC = the operator's RULES, locked-down
pods, namespaced mode, generated CRDs, clear refusals of bad values)."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from kube_schemas import problems, versions
from packaging_support import CHART, REPO, HelmError, example_values_files, run

pytestmark = pytest.mark.process  # real processes and sockets (tests/conftest.py)

VALUES = [None, *example_values_files()]
VALUE_IDS = ["default", *(p.stem for p in example_values_files())]

# Resources that exist outside namespaces: a Role cannot grant them.
CLUSTER_SCOPED = {
    ("", "namespaces"),
    ("", "nodes"),
    ("", "persistentvolumes"),
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("kopf.dev", "clusterkopfpeerings"),
    ("rbac.authorization.k8s.io", "clusterroles"),
    ("rbac.authorization.k8s.io", "clusterrolebindings"),
    ("storage.k8s.io", "storageclasses"),
    ("scheduling.k8s.io", "priorityclasses"),
    ("authorization.k8s.io", "selfsubjectaccessreviews"),
}


def _args(values) -> list[str]:
    return ["-f", str(values)] if values else []


def component(obj: dict) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/component")


def by_kind(objs: list[dict], kind: str, part: str = "operator") -> list[dict]:
    """Objects of `kind` of the operator (default) or of the gateway (test_gateway_chart.py)."""
    return [o for o in objs
            if o["kind"] == kind and (component(o) == "gateway") == (part == "gateway")]


def the(objs: list[dict], kind: str, part: str = "operator") -> dict:
    found = by_kind(objs, kind, part)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("values", VALUES, ids=VALUE_IDS)
def test_helm_lint_strict_passes(k8s_tools, values):
    proc = run([k8s_tools.helm, "lint", "--strict", CHART, *_args(values)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("values", VALUES, ids=VALUE_IDS)
def test_rendered_objects_are_valid_kubernetes_from_1_27_to_newest(helm_template, values):
    objs = helm_template("--include-crds", *_args(values))
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "ServiceAccount", "CustomResourceDefinition"} <= kinds
    assert versions()[0] == "1.27.0" and len(versions()) >= 5, versions()
    errors = [line for o in objs for line in problems(o)]
    assert not errors, "\n".join(errors)


def test_schema_validation_catches_an_unknown_field(helm_template):
    """The validation above can fail: a misspelt field is rejected in strict mode."""
    dep = copy.deepcopy(the(helm_template(), "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    assert problems(dep)


@pytest.mark.parametrize("values", VALUES, ids=VALUE_IDS)
def test_operator_pod_is_locked_down(helm_template, values):
    dep = the(helm_template(*_args(values)), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert sc.get("privileged") is not True
    # A read-only root needs somewhere to write: /tmp is an emptyDir.
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    # The liveness probe hits kopf's own endpoint, on the port the operator is told to serve it.
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert any(a.startswith("--liveness=http://0.0.0.0:8080/healthz") for a in c["args"])
    assert "readinessProbe" not in c


def test_values_reach_the_pod(helm_template):
    prod = REPO / "examples" / "values-production.yaml"
    values = yaml.safe_load(prod.read_text())
    dep = the(helm_template("-f", str(prod)), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == f"{values['image']['repository']}@{values['image']['digest']}"
    assert c["resources"] == values["resources"]
    assert pod["nodeSelector"] == values["nodeSelector"]
    lost = [{"key": f"node.kubernetes.io/{k}", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 30} for k in ("unreachable", "not-ready")]
    assert pod["tolerations"] == values["tolerations"] + lost, "the user's, then a lost node's"
    assert pod["imagePullSecrets"] == values["imagePullSecrets"]
    assert "--log-level=warning" in c["args"]

    dep = the(helm_template("--set", "image.tag=9.9.9", "--set", "logLevel=debug"), "Deployment")
    assert dep["spec"]["template"]["spec"]["tolerations"] == lost
    plain = the(helm_template("--set", "lostNodeTolerationSeconds=null"), "Deployment")
    assert "tolerations" not in plain["spec"]["template"]["spec"], "null: Kubernetes' default"
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "ghcr.io/shoal-dev/shoal-operator:9.9.9"
    assert "--log-level=debug" in c["args"]


# ---- RBAC: exactly the operator's rules ------------------------------------------------------


def triples(rules: list[dict]) -> set[tuple[str, str, str]]:
    """A rule list as (apiGroup, resource, verb) triples: order and grouping don't matter."""
    out = set()
    for r in rules:
        assert not r.get("resourceNames") and not r.get("nonResourceURLs"), r
        for g in r["apiGroups"]:
            for res in r["resources"]:
                for v in r["verbs"]:
                    out.add((g, res, v))
    return out


def operator_rules(namespaced: bool = False) -> list[dict]:
    """RULES; in namespaced mode also NAMESPACE_RULES (kopf follows the namespaces it is given)."""
    from shoal.operator.rbac import NAMESPACE_RULES, RULES

    return RULES + (NAMESPACE_RULES if namespaced else [])


def expected_chart_rules() -> str:
    """The _rules.tpl body to paste when RULES changed (printed by the failing test)."""
    rules = operator_rules()
    cluster = [r for r in rules
               if all((g, res.split("/")[0]) in CLUSTER_SCOPED
                      for g in r["apiGroups"] for res in r["resources"])]
    ns = [r for r in rules if r not in cluster]
    dump = lambda rs: yaml.safe_dump(rs, sort_keys=False, default_flow_style=None).strip()  # noqa: E731
    from shoal.operator.rbac import NAMESPACE_RULES

    return (f"shoal.rules.namespaced:\n{dump(ns)}\n"
            f"shoal.rules.cluster:\n{dump(cluster) if cluster else '[]'}\n"
            f"shoal.rules.namespaceObserver:\n{dump(NAMESPACE_RULES)}")


def test_cluster_wide_rbac_grants_exactly_the_operators_rules(helm_template):
    objs = helm_template()
    role = the(objs, "ClusterRole")
    assert not by_kind(objs, "Role")
    got, want = triples(role["rules"]), triples(operator_rules())
    assert got == want, (
        f"chart grants {sorted(got - want)} beyond RULES and lacks {sorted(want - got)}; "
        f"update charts/shoal/templates/_rules.tpl to:\n{expected_chart_rules()}"
    )
    assert all("*" not in t for t in got), "no wildcard grants"
    binding = the(objs, "ClusterRoleBinding")
    sa = the(objs, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "shoal-system"}
    ]
    dep = the(objs, "Deployment")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    assert "--all-namespaces" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_namespaced_mode_uses_a_role_in_each_watched_namespace(helm_template):
    values = REPO / "examples" / "values-namespaced.yaml"
    watched = yaml.safe_load(values.read_text())["watchNamespaces"]
    objs = helm_template("-f", str(values))
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(watched)
    bindings = by_kind(objs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(watched)
    for b in bindings:
        assert b["subjects"][0]["namespace"] == "shoal-system"
    cluster = by_kind(objs, "ClusterRole")
    # A ClusterRole remains only for cluster-scoped resources, never for namespaced ones.
    for role in cluster:
        for g, res, _ in triples(role["rules"]):
            assert (g, res.split("/")[0]) in CLUSTER_SCOPED, f"cluster-wide grant of {g}/{res}"
    granted = set().union(*(triples(r["rules"]) for r in roles + cluster))
    assert granted == triples(operator_rules(namespaced=True))
    # Namespaced rules are granted per namespace only, never through the ClusterRole.
    namespaced_part = set().union(*(triples(r["rules"]) for r in roles))
    assert namespaced_part == {t for t in triples(operator_rules())
                               if (t[0], t[1].split("/")[0]) not in CLUSTER_SCOPED}
    args = the(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert ([a for a in args if a.startswith("--namespace=")]
            == [f"--namespace={n}" for n in watched])
    assert "--all-namespaces" not in args


# ---- refusals with a clear message -----------------------------------------------------------


@pytest.mark.parametrize(
    "sets,message",
    [
        (["replicaCount=2"], "replicaCount=2: the Shoal operator runs as one replica"),
        (["watchNamespaces={Team_A}"], '"Team_A" is not a namespace name'),
        (["logLevel=loud"], "value must be one of 'debug', 'info', 'warning', 'error'"),
        (["image.pullPolicy=Sometimes"], "value must be one of 'Always', 'IfNotPresent', 'Never'"),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(helm_template, sets, message):
    with pytest.raises(HelmError) as err:
        helm_template(*(a for s in sets for a in ("--set", s)))
    assert message in str(err.value)


def test_notes_tell_the_next_command(k8s_tools):
    proc = run([k8s_tools.helm, "install", "shoal", CHART, "--dry-run=client", "-n", "ops",
                "-f", REPO / "examples" / "values-namespaced.yaml"])
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "kubectl --namespace ops rollout status deployment/shoal-operator" in notes
    assert "kubectl --namespace team-a apply -f examples/cpu-single.yaml" in notes
    assert "get ie" in notes


# ---- CRDs: the chart ships exactly the generated file ----------------------------------------


def test_chart_crds_are_the_generated_crds(helm_template):
    from shoal.operator import crd

    for path, generated in crd.outputs().items():
        assert path.read_text() == generated, "run python -m shoal.operator.crd --write"
    assert (sorted(p.name for p in (CHART / "crds").iterdir())
            == sorted(p.name for p in (REPO / "crds").iterdir()))
    shipped = by_kind(helm_template("--include-crds"), "CustomResourceDefinition")
    by_name = {c["metadata"]["name"]: c for c in crd.crds()}
    assert sorted(shipped, key=lambda c: c["metadata"]["name"]) == [
        by_name[n] for n in sorted(by_name)]


def test_chart_readme_documents_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    table = {line.split("|")[1].strip().strip("`") for line in readme.splitlines()
             if line.startswith("| `")}
    keys = set()
    for k, v in values.items():
        nested = isinstance(v, dict) and v and k not in ("resources", "podSecurityContext",
                                                         "securityContext")
        keys |= {f"{k}.{sub}" for sub in v} if nested else {k}
    assert keys <= table, f"undocumented in charts/shoal/README.md: {sorted(keys - table)}"
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values) == set(schema["properties"]), "values.yaml and values.schema.json disagree"


def test_packaged_chart_renders_like_the_source(k8s_tools, helm_template, tmp_path):
    """`helm package` keeps every file the templates need (.helmignore drops none of them)."""
    proc = run([k8s_tools.helm, "package", CHART, "--destination", tmp_path])
    assert proc.returncode == 0, proc.stderr
    (tgz,) = tmp_path.glob("shoal-*.tgz")
    out = run([k8s_tools.helm, "template", "shoal", tgz, "--namespace", "shoal-system",
               "--include-crds"])
    assert out.returncode == 0, out.stderr
    assert [d for d in yaml.safe_load_all(out.stdout) if d] == helm_template("--include-crds")
