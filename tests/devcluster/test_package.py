"""The package as a whole: standard library only, runnable from a bare python3, one CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from shoal.devcluster import cli, images, layout

MODULES = ("api", "build", "clean", "cli", "cluster", "components", "control_plane", "demo",
           "dns", "explain", "images", "layout", "net", "node", "pki", "procs")
THIRD_PARTY = ("kubernetes", "kopf", "torch", "yaml", "httpx", "pytest", "psutil")


@pytest.mark.process
def test_every_module_imports_from_a_bare_python_without_third_party_packages():
    code = ("import importlib, sys\n"
            f"for m in {MODULES!r}: importlib.import_module('shoal.devcluster.' + m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {THIRD_PARTY!r}))\n")
    env = {**os.environ, "PYTHONPATH": str(layout.PACKAGE_DIR.parents[1])}
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("argv, want", [
    (["build"], {"cmd": "build", "sets": []}),
    (["build", "node", "control-plane"], {"cmd": "build", "sets": ["node", "control-plane"]}),
    (["start"], {"cmd": "start"}),
    (["demo", "--model", "/m", "--kubectl", "/k", "--helm", "/h"],
     {"cmd": "demo", "model": Path("/m"), "kubectl": "/k", "helm": "/h"}),
    (["image", "router"], {"cmd": "image", "target": "router"}),
    (["control-plane", "start", "/tmp/cp", "--foreground"],
     {"cmd": "control-plane", "action": "start", "dir": Path("/tmp/cp"), "foreground": True,
      "no_build": False}),
    (["control-plane", "stop", "/tmp/cp"],
     {"cmd": "control-plane", "action": "stop", "dir": Path("/tmp/cp")}),
])
def test_cli_arguments(argv, want):
    got = vars(cli.parser().parse_args(argv))
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("target, tag", [
    ("operator", "ghcr.io/shoal-dev/shoal-operator:0.1.0"),
    ("engine", "ghcr.io/shoal-dev/shoal:0.1.0"),
    ("router", "ghcr.io/shoal-dev/shoal-router:0.1.0"),
])
def test_images_build_every_dockerfile_target_the_cluster_runs(target, tag):
    dockerfile = (layout.REPO / "Dockerfile").read_text()
    assert images.TARGETS[target] == tag
    assert f" AS {target}\n" in dockerfile


def test_image_inputs_cover_every_source_root():
    roots = {p.parents[2].name for p in layout.REPO.glob("*/shoal/*/__init__.py")}
    roots.discard("devcluster")  # not in the images
    assert roots <= set(images.CONTEXT_PATHS), roots - set(images.CONTEXT_PATHS)
