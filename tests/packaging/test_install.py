"""Install the chart into the real test control plane (kube-apiserver 1.20 + etcd +
controller-manager, no kubelet) with the real helm and kubectl binaries.

What the API server must accept: the CRD (structural schema), the RBAC objects, the
ServiceAccount and the operator Deployment (its pods never run: there is no kubelet). Then an
example InferenceEngine passes the API server's validation on `kubectl apply`, and a broken one
is rejected with a message that names the field and the bound.
"""

from __future__ import annotations

import json

import pytest
from packaging_support import CHART, DATA, EXAMPLES, example_engines, load_all
from support.k8s_tools import KubeCli
from support.wait import wait_for

pytestmark = pytest.mark.k8s

CRD_NAME = "inferenceengines.shoal.dev"


class Cli(KubeCli):
    """helm and kubectl pointed at the control plane (caches in a temp dir); the tests read
    each command's exit code themselves."""

    def of_release(self, kind: str, release: str, *args) -> dict:
        """The one operator object of `kind` that the release made (selected by its instance and
        component labels; the gateway's are component=gateway)."""
        found = self.get_json(kind, "-l", f"app.kubernetes.io/instance={release},"
                              "app.kubernetes.io/component=operator", *args)["items"]
        assert len(found) == 1, f"expected one {kind} of release {release}, found {len(found)}"
        return found[0]


@pytest.fixture(scope="module")
def cli(k8s_tools, control_plane, tmp_path_factory):
    return Cli(k8s_tools, control_plane.kubeconfig, tmp_path_factory.mktemp("k8s-cli"),
               check=False)


def _triples(rules):
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


@pytest.fixture(scope="module")
def release(cli, control_plane):
    """The chart installed cluster-wide into its own namespace; uninstalled afterwards."""
    ns = control_plane.new_namespace("shoal-system")
    name = ns  # release names make cluster-scoped names: unique per test run
    # The CRD may already be there (the operator tests install it from crds/ with another
    # field manager): helm's server-side apply then takes the fields over, as a user would.
    proc = cli.helm("install", name, CHART, "--namespace", ns, "--timeout", "60s",
                    "--force-conflicts")
    assert proc.returncode == 0, f"helm install failed:\n{proc.stdout}\n{proc.stderr}"
    yield name, ns
    proc = cli.helm("uninstall", name, "--namespace", ns, "--timeout", "60s")
    assert proc.returncode == 0, proc.stderr
    cli.kubectl("delete", "namespace", ns, "--wait=false")


def test_helm_install_is_accepted_by_the_api_server(cli, release):
    name, ns = release
    status = json.loads(cli.helm("status", name, "--namespace", ns, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"

    def established():
        crd = cli.get_json("crd", CRD_NAME)
        conds = {c["type"]: c["status"] for c in crd["status"].get("conditions", [])}
        return conds.get("Established") == "True" and conds.get("NamesAccepted") == "True" and crd

    crd = wait_for(established, timeout=30, interval=0.2, what=f"CRD {CRD_NAME} Established")
    assert crd["spec"]["names"]["shortNames"] == ["ie"]

    from shoal.operator.rbac import RULES

    role = cli.of_release("clusterrole", name)
    assert _triples(role["rules"]) == _triples(RULES)
    binding = cli.of_release("clusterrolebinding", name)
    sa = cli.of_release("serviceaccount", name, "-n", ns)
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": ns}]
    dep = cli.of_release("deployment", name, "-n", ns)
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


def test_namespaced_install_creates_a_role_in_each_watched_namespace(cli, control_plane):
    ns = control_plane.new_namespace("shoal-ops")
    watched = [control_plane.new_namespace("team-a"), control_plane.new_namespace("team-b")]
    proc = cli.helm("install", ns, CHART, "--namespace", ns, "--force-conflicts",
                    "--set", f"watchNamespaces={{{','.join(watched)}}}")
    assert proc.returncode == 0, f"helm install failed:\n{proc.stdout}\n{proc.stderr}"
    try:
        from shoal.operator.rbac import NAMESPACE_RULES, RULES

        granted = set()
        for w in watched:
            role = cli.of_release("role", ns, "-n", w)
            binding = cli.of_release("rolebinding", ns, "-n", w)
            assert binding["subjects"][0]["namespace"] == ns
            granted |= _triples(role["rules"])
        cluster = cli.get_json("clusterrole", "-l", f"app.kubernetes.io/instance={ns}")["items"]
        granted |= set().union(*(_triples(c["rules"]) for c in cluster))
        assert granted == _triples(RULES + NAMESPACE_RULES)
        dep = cli.of_release("deployment", ns, "-n", ns)
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert ([a for a in args if a.startswith("--namespace=")]
                == [f"--namespace={w}" for w in watched])
    finally:
        cli.helm("uninstall", ns, "--namespace", ns)
        for n in [ns, *watched]:
            cli.kubectl("delete", "namespace", n, "--wait=false")


def test_example_inferenceengine_passes_api_validation(cli, release, control_plane):
    ns = control_plane.new_namespace("ie-examples")
    try:
        proc = cli.kubectl("apply", "-n", ns, "-f", EXAMPLES / "cpu-single.yaml")
        assert proc.returncode == 0, proc.stderr
        assert "inferenceengine.shoal.dev/shoal-tiny created" in proc.stdout
        stored = cli.get_json("ie", "shoal-tiny", "-n", ns)
        # The structural schema's defaults were applied by the API server.
        assert stored["spec"]["restartPolicy"]["policy"] == "RecreateGroupOnFailure"
        assert stored["spec"]["shutdown"]["timeoutSeconds"] == 30
        table = cli.kubectl("get", "ie", "-n", ns)
        assert table.returncode == 0, table.stderr
        assert table.stdout.split("\n")[0].split() == ["NAME", "READY", "PHASE", "MODEL",
                                                       "ENDPOINT", "AGE"]
        # Every other example passes too (server-side dry run: validated, not stored).
        for path in example_engines():
            proc = cli.kubectl("apply", "--dry-run=server", "-n", ns, "-f", path)
            assert proc.returncode == 0, f"{path.name}: {proc.stderr}"
    finally:
        cli.kubectl("delete", "namespace", ns, "--wait=false")


def test_broken_inferenceengine_is_rejected_with_a_clear_message(cli, release, control_plane):
    ns = control_plane.new_namespace("ie-broken")
    try:
        proc = cli.kubectl("apply", "-n", ns, "-f", DATA / "broken-inferenceengine.yaml")
        assert proc.returncode != 0
        assert 'The InferenceEngine "broken" is invalid' in proc.stderr
        assert ("spec.replicas: Invalid value: -1: spec.replicas in body should be greater than "
                "or equal to 0") in proc.stderr
        (broken,) = load_all(DATA / "broken-inferenceengine.yaml")
        assert cli.kubectl("get", "ie", broken["metadata"]["name"], "-n", ns).returncode != 0, \
            "nothing stored"
    finally:
        cli.kubectl("delete", "namespace", ns, "--wait=false")


@pytest.mark.parametrize("model, why", [("hf://Qwen", "hf:// without ORG/NAME"),
                                        ("s3://bucket/model", "a scheme Shoal does not fetch"),
                                        ("oci://Registry/Model:1", "not a lowercase image"),
                                        ("pvc://Bad_Claim/model", "not a claim name")])
def test_a_bad_model_reference_is_rejected_naming_spec_model(cli, release, control_plane,
                                                             tmp_path, model, why):
    ns = control_plane.new_namespace("ie-model")
    (ie,) = load_all(EXAMPLES / "cpu-single.yaml")
    ie["spec"]["model"] = model
    manifest = tmp_path / "bad-model.json"
    manifest.write_text(json.dumps(ie))
    try:
        proc = cli.kubectl("apply", "-n", ns, "-f", manifest)
        assert proc.returncode != 0, why
        assert f'The InferenceEngine "{ie["metadata"]["name"]}" is invalid' in proc.stderr
        assert f'spec.model: Invalid value: "{model}": spec.model in body should match' \
            in proc.stderr, proc.stderr
    finally:
        cli.kubectl("delete", "namespace", ns, "--wait=false")
