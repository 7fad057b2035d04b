"""The operator's command line and its import boundary (no torch in the operator image)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from shoal.operator.__main__ import parse_args


def test_the_operator_imports_without_torch():
    code = ("import sys, shoal.operator.handlers, shoal.operator.render, shoal.operator.crd, "
            "shoal.operator.rbac; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_namespace_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.delenv("SHOAL_NAMESPACES", raising=False)
    monkeypatch.delenv("SHOAL_ALL_NAMESPACES", raising=False)
    with pytest.raises(SystemExit) as exc:
        parse_args([])
    assert exc.value.code == 2 and "--namespace NS" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, env, namespaces, clusterwide",
    [
        (["-n", "a", "-n", "llm-*"], {}, ["a", "llm-*"], False),
        ([], {"SHOAL_NAMESPACES": "x,y"}, ["x", "y"], False),
        (["--all-namespaces"], {}, [], True),
        ([], {"SHOAL_ALL_NAMESPACES": "1"}, [], True),
    ],
)
def test_namespaces_from_flags_or_environment(monkeypatch, argv, env, namespaces, clusterwide):
    for k in ("SHOAL_NAMESPACES", "SHOAL_ALL_NAMESPACES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = parse_args(argv)
    assert args.all_namespaces is clusterwide and (args.namespace or []) == namespaces


@pytest.mark.parametrize("argv, env, port", [
    (["-A"], {}, 0),
    (["-A", "--metrics-port", "8081"], {}, 8081),
    (["-A"], {"SHOAL_METRICS_PORT": "9100"}, 9100),
])
def test_metrics_port_from_flag_or_environment(monkeypatch, argv, env, port):
    monkeypatch.delenv("SHOAL_METRICS_PORT", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert parse_args(argv).metrics_port == port
