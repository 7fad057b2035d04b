"""Cold start of one engine group on the local cluster, per stage, for each model source, and
the same with a warm cache; then the downloads per engine of 2 groups x 2 ranks sharing a cache.

    sudo PYTHONPATH=tests .venv/bin/python benchmarks/cold_start.py [--keep] [--skip-groups]

Uses a running cluster (make cluster) or starts one (and stops it unless --keep). Sources: a
path on the nodes' hostPath (spec.modelVolume), pvc:// (a hostPath PersistentVolume), hf://
from the stand-in hub pod (support/hub_pod.py: a stand-in; `shoal fetch` and huggingface_hub
are real) into a fresh hostPath cache, then again from that cache, and oci:// (the model image
imported into the nodes first: no registry here, so `ctr import` stands in for the pull).

Stages of rank 0 of group 0, from the pod's status (1 s resolution) and its engine log's
timestamps: created -> scheduled (PodScheduled) -> init container started (the image was there:
a pull on a real cluster) -> model fetched or copied (init container finished) -> engine
container started -> `loading model` -> KV sized (`KV cache N blocks`) -> serving (`ready:`)
-> pod Ready. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
import time
import uuid

from bench_cluster import local_cluster
from e2e.e2e_helpers import completes, condition_time, create, iso_seconds, service_url, wait_ready
from shoal.devcluster import cluster as devcluster
from shoal.devcluster import images
from shoal.devcluster.layout import MODEL_HOST_DIR, VAR_DIR
from support import hub_pod
from support.cluster import Cluster
from support.wait import wait_for

REPO = f"{hub_pod.ORG}/shoal-tiny"
SMALL = {"max_model_len": 256}
LOG_MARKS = (("loading model", "engine: loading model"), (" KV cache ", "engine: KV sized"),
             ("/v1 serving ", "engine: serving"))


def _log_time(line: str) -> float:
    """`kubectl logs --timestamps` stamps (RFC 3339, nanoseconds) as epoch seconds."""
    stamp = line.split(" ", 1)[0].rstrip("Z")[:26]
    return dt.datetime.fromisoformat(stamp).replace(tzinfo=dt.timezone.utc).timestamp()


def stages(pod: dict, log: str) -> list[tuple[str, float]]:
    """(stage, seconds since the pod was created) in order; a stage the pod never had (no init
    container) is left out. Pure: the pod object and its engine log with timestamps."""
    created = iso_seconds(pod["metadata"]["creationTimestamp"])
    st = pod.get("status") or {}
    out = [("scheduled", condition_time(pod, "PodScheduled"))]
    for init in st.get("initContainerStatuses") or []:
        done = (init.get("state") or {}).get("terminated") or {}
        out += [(f"{init['name']}: started", iso_seconds(done.get("startedAt"))),
                (f"{init['name']}: finished", iso_seconds(done.get("finishedAt")))]
    engine = next(c for c in st.get("containerStatuses") or [] if c["name"] == "engine")
    out.append(("engine container started",
                iso_seconds(((engine.get("state") or {}).get("running") or {}).get("startedAt"))))
    lines = log.splitlines()
    for needle, stage in LOG_MARKS:
        hit = next((ln for ln in lines if needle in ln), None)
        out.append((stage, _log_time(hit) if hit else None))
    out.append(("pod Ready", condition_time(pod, "Ready")))
    return [(name, t - created) for name, t in out if t is not None]


def measure(c: Cluster, ns: str, name: str, ready: str = "1/1", **kw) -> list[tuple[str, float]]:
    t0 = time.monotonic()
    create(c, ns, name, **kw)
    wait_ready(c, ns, name, ready, timeout=600)
    url = service_url(c, ns, name)
    wait_for(lambda: completes(url), timeout=300, interval=0.5, what="first token")
    first_token = time.monotonic() - t0
    pod = c.get("pod", f"{name}-g0-r0", "-n", ns)
    log = c.kubectl("logs", "-n", ns, f"{name}-g0-r0", "-c", "engine", "--timestamps").stdout
    return stages(pod, log) + [("first token (from apply, host clock)", first_token)]


def pvc_objects(ns: str, name: str) -> list[dict]:
    """A hostPath PersistentVolume holding the nodes' model directory, bound to one claim."""
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-{name}"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                   "storageClassName": "", "persistentVolumeReclaimPolicy": "Retain",
                   "hostPath": {"path": str(MODEL_HOST_DIR), "type": "Directory"}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": name, "namespace": ns},
           "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                    "volumeName": f"{ns}-{name}", "resources": {"requests": {"storage": "1Gi"}}}}
    return [pv, pvc]


def table(runs: dict[str, list[tuple[str, float]]]) -> str:
    names: list[str] = []  # every run's stages, a stage one run lacks kept in its place
    for rows in runs.values():
        for i, (n, _) in enumerate(rows):
            if n not in names:
                names.insert(names.index(rows[i - 1][0]) + 1 if i else 0, n)
    head = "| stage (s since pod created) | " + " | ".join(runs) + " |"
    out = [head, "|---|" + "---:|" * len(runs)]
    for n in names:
        cells = [next((f"{t:.1f}" for k, t in rows if k == n), "-") for rows in runs.values()]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="leave a cluster this run started up")
    ap.add_argument("--skip-groups", action="store_true", help="skip the 2 x 2 download count")
    args = ap.parse_args()
    c = local_cluster()
    ns = c.new_namespace("bench-cold")
    cache = VAR_DIR / f"bench-model-cache-{uuid.uuid4().hex[:6]}"
    cache.mkdir(parents=True)
    cache.chmod(0o777)  # the fetcher runs as uid 10001
    runs: dict[str, list[tuple[str, float]]] = {}
    notes: list[str] = []
    try:
        hub = hub_pod.start(c, ns)
        c.kubectl("create", "secret", "generic", "hf-token", "-n", ns,
                  f"--from-literal=HF_TOKEN={hub_pod.TOKEN}")
        hf = {"model": f"hf://{REPO}@main", "hfEndpoint": hub["endpoint"],
              "modelAuth": {"secretName": "hf-token"},
              "modelCache": {"hostPath": {"path": str(cache)}}, **SMALL}
        runs["path (hostPath)"] = measure(c, ns, "path", **SMALL)
        for obj in pvc_objects(ns, "models"):
            c.apply(obj)
        runs["pvc://"] = measure(c, ns, "pvc", model="pvc://models/shoal-tiny", **SMALL)
        runs["hf:// cold cache"] = measure(c, ns, "hf-cold", **hf)
        runs["hf:// warm cache"] = measure(c, ns, "hf-warm", **hf)
        tag = "localhost/shoal/model-shoal-tiny:bench"
        t = time.monotonic()
        images.ensure_model_image(MODEL_HOST_DIR / "shoal-tiny", tag)
        notes.append(f"oci:// model image built (or found) and imported into both nodes in "
                     f"{time.monotonic() - t:.1f} s before the apply")
        runs["oci:// first pod"] = measure(c, ns, "oci-a", model=f"oci://{tag}", **SMALL)
        runs["oci:// again"] = measure(c, ns, "oci-b", model=f"oci://{tag}", **SMALL)
        for name in ("path", "pvc", "hf-cold", "hf-warm", "oci-a", "oci-b"):
            c.kubectl("delete", "ie", name, "-n", ns, "--wait=false", check=False)
        if not args.skip_groups:
            shared = VAR_DIR / f"bench-model-cache-{uuid.uuid4().hex[:6]}"
            shared.mkdir(parents=True)
            shared.chmod(0o777)
            before = hub_pod.stats(hub)["downloads"]
            t = time.monotonic()
            create(c, ns, "hf-2x2", replicas=2, nodes_per_group=2, tensor_parallel=2,
                   extra_args=["--dtype", "float32"],
                   **{**hf, "modelCache": {"hostPath": {"path": str(shared)}}})
            wait_ready(c, ns, "hf-2x2", "2/2", timeout=600)
            got = hub_pod.downloads_since(hub, before, REPO)
            notes.append(f"2 groups x 2 ranks, one hostPath cache: Ready in "
                         f"{time.monotonic() - t:.0f} s; 4 engine pods, {len(got)} files, "
                         f"{sum(got.values())} file downloads (times each file was downloaded: "
                         f"{sorted(set(got.values()))}); {sum(got.values()) / len(got) / 4:.2f} "
                         f"downloads of the model per engine pod")
            shutil.rmtree(shared, ignore_errors=True)
    finally:
        c.kubectl("delete", "ns", ns, "--wait=false", check=False)
        c.kubectl("delete", "pv", f"{ns}-models", "--wait=false", check=False)
        shutil.rmtree(cache, ignore_errors=True)
        if not c.reused and not args.keep:
            devcluster.stop()
    from prefix_routing import cpu_flags  # the benchmarks' one CPU description

    print("\n" + cpu_flags() + "\n\n" + table(runs) + "\n")
    for n in notes:
        print(f"- {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
