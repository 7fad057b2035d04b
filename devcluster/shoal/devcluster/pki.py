"""The control plane's credentials: a throw-away CA and serving certificate (openssl), the
service-account key pair, the static token file and kubeconfigs.

Why static tokens and a private CA: nothing here outlives a test session or a dev cluster, and
every client (kubectl, kopf, the Python client, the kubelets) reads a token from a kubeconfig.
"""

from __future__ import annotations

import json
from pathlib import Path

from shoal.devcluster.procs import run

CA_SUBJECT = "/CN=shoal-test-ca"
# Names the API server answers to: loopback, the `kubernetes` Service's first address and names.
SERVICE_IP = "10.96.0.1"
SERVICE_NAMES = ("kubernetes", "kubernetes.default", "kubernetes.default.svc")
DAYS = "3650"


def san_extension(extra_ips: tuple[str, ...] = ()) -> str:
    """The serving certificate's extensions (openssl -extfile): 127.0.0.1, `extra_ips`, the
    Service address and names."""
    ips = "".join(f"IP:{ip}," for ip in extra_ips if ip != "127.0.0.1")
    names = ",".join(f"DNS:{n}" for n in ("localhost", *SERVICE_NAMES))
    return (f"subjectAltName=IP:127.0.0.1,{ips}IP:{SERVICE_IP},{names}\n"
            "extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n")


def _openssl(pki: Path, *args: str) -> None:
    run(["openssl", *args], cwd=pki)


def make_pki(pki: Path, extra_ips: tuple[str, ...] = ()) -> None:
    """CA, serving certificate for 127.0.0.1/localhost (and `extra_ips`), and the
    service-account key pair; kept when already there."""
    pki.mkdir(parents=True, exist_ok=True)
    if (pki / "apiserver.crt").is_file() and (pki / "sa.pub").is_file():
        return
    _openssl(pki, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
             "-out", "ca.crt", "-days", DAYS, "-subj", CA_SUBJECT)
    _openssl(pki, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key",
             "-out", "apiserver.csr", "-subj", "/CN=kube-apiserver")
    (pki / "san.ext").write_text(san_extension(extra_ips))
    _openssl(pki, "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "apiserver.crt", "-days", DAYS, "-extfile", "san.ext")
    _openssl(pki, "genrsa", "-out", "sa.key", "2048")
    _openssl(pki, "rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")


def write_tokens(path: Path, token: str) -> None:
    """The API server's static token file: one admin (group system:masters)."""
    path.write_text(f'{token},admin,admin,"system:masters"\n')


def kubeconfig(server: str, ca: Path, token: str, user: str = "admin") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "shoal-test", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {
                "name": "shoal-test",
                "context": {"cluster": "shoal-test", "user": user, "namespace": "default"},
            }
        ],
        "current-context": "shoal-test",
    }


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, user: str = "admin") -> None:
    # JSON is valid YAML: kubectl, kopf and the Python client all read it.
    path.write_text(json.dumps(kubeconfig(server, ca, token, user), indent=2) + "\n")
    path.chmod(0o600)
