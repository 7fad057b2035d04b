"""Why pods are not running: a few lines built from the API's own objects, for the error a
harness raises when a rollout or a wait times out (a bare "timed out waiting for the condition"
names no cause).

Pure: `explain` takes the JSON of `kubectl get pods,nodes,events -o json` and returns text.
"""

from __future__ import annotations

PRESSURES = ("DiskPressure", "MemoryPressure", "PIDPressure", "NetworkUnavailable")


def pod_lines(pods: list[dict]) -> list[str]:
    """One line per pod that is not Running and ready: phase, node, the failing condition's
    message (the scheduler writes why no node fits), and each waiting or failed container."""
    lines = []
    for pod in pods:
        name = pod["metadata"]["name"]
        status = pod.get("status", {})
        conds = {c["type"]: c for c in status.get("conditions", [])}
        if status.get("phase") == "Running" and conds.get("Ready", {}).get("status") == "True":
            continue
        parts = [f"pod {name}: {status.get('phase', '?')}",
                 f"node {pod.get('spec', {}).get('nodeName') or '(none)'}"]
        for ctype in ("PodScheduled", "Initialized", "ContainersReady"):
            c = conds.get(ctype)
            if c and c["status"] != "True" and (c.get("reason") or c.get("message")):
                parts.append(f"{ctype}: {c.get('reason', '')} {c.get('message', '')}".strip())
        for cs in status.get("initContainerStatuses", []) + status.get("containerStatuses", []):
            state = cs.get("state", {})
            last = cs.get("lastState", {}).get("terminated")
            if "waiting" in state:
                w = state["waiting"]
                parts.append(f"container {cs['name']} waiting: {w.get('reason', '')} "
                             f"{w.get('message', '')}".strip())
            elif "terminated" in state:
                t = state["terminated"]
                parts.append(f"container {cs['name']} exited {t.get('exitCode')}: "
                             f"{t.get('reason', '')} {t.get('message', '')}".strip())
            if last:
                parts.append(f"container {cs['name']} last exit {last.get('exitCode')} "
                             f"({last.get('reason', '')}), restarts {cs.get('restartCount', 0)}")
        lines.append("; ".join(parts))
    return lines


def node_lines(nodes: list[dict]) -> list[str]:
    """Nodes that are not Ready, under pressure, or tainted (a taint is what keeps pods off)."""
    lines = []
    for node in nodes:
        name = node["metadata"]["name"]
        conds = {c["type"]: c for c in node.get("status", {}).get("conditions", [])}
        bad = [f"{t}: {conds[t].get('message', '')}".strip() for t in PRESSURES
               if conds.get(t, {}).get("status") == "True"]
        ready = conds.get("Ready", {})
        if ready.get("status") != "True":
            bad.insert(0, f"not Ready: {ready.get('reason', '')} {ready.get('message', '')}"
                       .strip())
        taints = [f"{t['key']}:{t['effect']}" for t in node.get("spec", {}).get("taints", [])]
        if taints:
            bad.append("taints " + ", ".join(taints))
        if bad:
            lines.append(f"node {name}: " + "; ".join(bad))
    return lines


def event_lines(events: list[dict], limit: int = 8) -> list[str]:
    """The latest Warning events (FailedScheduling, FailedMount, BackOff...), oldest first."""
    warn = [e for e in events if e.get("type") == "Warning"]
    warn.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return [f"event {e['involvedObject'].get('kind', '')}/{e['involvedObject'].get('name', '')}:"
            f" {e.get('reason', '')} (x{e.get('count', 1)}) {e.get('message', '').strip()}"
            for e in warn[-limit:]]


def explain(pods: dict, nodes: dict, events: dict) -> str:
    lines = (pod_lines(pods.get("items", [])) + node_lines(nodes.get("items", []))
             + event_lines(events.get("items", [])))
    return "\n".join(lines) if lines else "(every pod is running and every node is ready)"
