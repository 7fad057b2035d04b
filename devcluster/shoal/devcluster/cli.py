"""`python -m shoal.devcluster COMMAND`: the dev cluster's one command line.

The cluster with two nodes (root: network namespaces, mounts, cgroups):
  prepare [--vllm]        build what is missing: Kubernetes binaries and the images
                          (--vllm: the vLLM image too)
  start | stop | status   bring it up detached (prints cluster.json), tear it down, show it
  demo --model DIR        start, install the chart and an example, wait for a completion
  supervise               the detached supervisor `start` runs (not for hands)
  image TARGET            build one image: rootfs, base, pause, a Dockerfile target, or vllm
                          (images/vllm-cpu: stock vLLM for runtime VLLM; not part of prepare)
  resolve NAME            ask the cluster DNS for NAME
  freeze NODE | thaw NODE stop a node as a lost one stops (its kubelet, runtime and containers),
                          or resume it (freeze.py: the node-loss tests)
  apiserver-outage SECONDS  stop the API server that long, then start it again

The control plane alone (the operator tests' kind, for debugging):
  control-plane start DIR [--foreground] [--no-build]  |  control-plane stop DIR

  build [SET...]          build.sh: control-plane (default), node, all, packages
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from shoal.devcluster.procs import DevClusterError, log

NEEDS_ROOT = ("prepare", "start", "stop", "status", "demo", "supervise", "image", "freeze",
              "thaw", "apiserver-outage")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m shoal.devcluster",
                                 description="The dev cluster: Kubernetes built here, a control "
                                 "plane alone, or a local cluster with two nodes (root).")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    b = sub.add_parser("build", help="build.sh: Kubernetes from Debian's source")
    b.add_argument("sets", nargs="*", metavar="SET",
                   help="control-plane (the default), node, all, packages")
    pr = sub.add_parser("prepare", help="build what is missing: binaries and images")
    pr.add_argument("--vllm", action="store_true",
                    help="also the vLLM image (images/vllm-cpu, ~3 GB; for runtime VLLM tests)")
    for name, help_ in (("start", "start the cluster detached; prints cluster.json"),
                        ("stop", "stop the cluster and remove it from the host"),
                        ("status", "cluster.json of the running cluster"),
                        ("supervise", "the detached supervisor `start` runs")):
        sub.add_parser(name, help=help_)
    d = sub.add_parser("demo", help="what `make cluster` runs")
    d.add_argument("--model", type=Path, required=True, help="the model directory to serve")
    d.add_argument("--kubectl", default=shutil.which("kubectl") or "kubectl")
    d.add_argument("--helm", default=shutil.which("helm") or "helm")
    i = sub.add_parser("image", help="build one image archive")
    i.add_argument("target", choices=("rootfs", "base", "pause", "operator", "engine", "router",
                                          "vllm"))
    r = sub.add_parser("resolve", help="ask the cluster DNS")
    r.add_argument("name")
    o = sub.add_parser("apiserver-outage", help="stop the API server for SECONDS, restart it")
    o.add_argument("seconds", type=float)
    for name, help_ in (("freeze", "stop a node as a lost node stops"),
                        ("thaw", "resume a frozen node")):
        f = sub.add_parser(name, help=help_)
        f.add_argument("node")
    cp = sub.add_parser("control-plane", help="a control plane alone, state in DIR")
    cp_sub = cp.add_subparsers(dest="action", required=True)
    st = cp_sub.add_parser("start", help="start one with its state in DIR (detached)")
    st.add_argument("dir", type=Path)
    st.add_argument("--foreground", action="store_true",
                    help="stay attached; Ctrl-C/SIGTERM stops everything")
    st.add_argument("--no-build", action="store_true", help="fail instead of running build.sh")
    sp = cp_sub.add_parser("stop", help="stop the one started detached in DIR")
    sp.add_argument("dir", type=Path)
    return ap


def control_plane_command(args: argparse.Namespace) -> int:
    from shoal.devcluster import build, control_plane

    root = args.dir.resolve()
    if args.action == "stop":
        n = control_plane.stop_dir(root)
        print(f"stopped {n} process(es)" if n else f"nothing running in {root}")
        return 0
    if (root / "state.json").exists():
        print(f"{root} already has a running control plane; stop it first", file=sys.stderr)
        return 1
    if not args.no_build and not build.control_plane_built():
        print(f"building the control plane ({build.BUILD_SCRIPT}); first build takes ~10-20 min",
              file=sys.stderr)
        build.run_build()
    if args.foreground:
        return control_plane.run_foreground(root)
    return control_plane.start_detached(root)


def image_command(target: str) -> int:
    from shoal.devcluster import images
    from shoal.devcluster.layout import bin_dir

    if target == "rootfs":
        print(images.ensure_rootfs())
    elif target == "base":
        images.ensure_base()
    elif target == "pause":
        print(images.build_pause(bin_dir() / "pause"))
    elif target == "vllm":
        from shoal.devcluster import vllm_image

        print(vllm_image.build_vllm_image())
    else:
        print(images.build_target(target, images.TARGETS[target]))
    return 0


def cluster_command(args: argparse.Namespace) -> int:
    from shoal.devcluster import cluster, demo

    if args.cmd == "supervise":
        return cluster.supervise()
    if args.cmd == "prepare":
        cluster.prepare()
        if args.vllm:
            from shoal.devcluster import vllm_image

            vllm_image.build_vllm_image()
        return 0
    if args.cmd == "start":
        print(json.dumps(cluster.start(), indent=2))
        return 0
    if args.cmd == "stop":
        return 1 if cluster.stop() else 0
    if args.cmd == "apiserver-outage":
        print(json.dumps(cluster.apiserver_outage(args.seconds)))
        return 0
    if args.cmd == "demo":
        return demo.run_demo(args.model, args.kubectl, args.helm)
    state = cluster.running_state()
    print(json.dumps(state, indent=2) if state else "not running")
    return 0 if state else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd in NEEDS_ROOT and os.geteuid() != 0:
        print(f"`{args.cmd}` needs root (network namespaces, mounts, cgroups, image builds)",
              file=sys.stderr)
        return 2
    try:
        if args.cmd == "control-plane":
            return control_plane_command(args)
        if args.cmd == "build":
            from shoal.devcluster import build

            build.run_build(*args.sets)
            return 0
        if args.cmd == "image":
            return image_command(args.target)
        if args.cmd in ("freeze", "thaw"):
            from shoal.devcluster import freeze

            print(json.dumps(getattr(freeze, args.cmd)(args.node)))
            return 0
        if args.cmd == "resolve":
            from shoal.devcluster import dns

            print(dns.resolves(args.name) or "no answer")
            return 0
        return cluster_command(args)
    except DevClusterError as exc:
        log(f"ERROR: {exc}")
        return 1
