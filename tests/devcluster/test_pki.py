"""The control plane's credentials (shoal.devcluster.pki)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from shoal.devcluster import pki


@pytest.mark.parametrize("extra, want", [
    ((), "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
         "DNS:kubernetes.default,DNS:kubernetes.default.svc"),
    (("127.0.0.1",), "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
                     "DNS:kubernetes.default,DNS:kubernetes.default.svc"),
    (("10.213.0.1",), "subjectAltName=IP:127.0.0.1,IP:10.213.0.1,IP:10.96.0.1,DNS:localhost,"
                      "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"),
])
def test_serving_certificate_names(extra, want):
    ext = pki.san_extension(extra).splitlines()
    assert ext == [want, "extendedKeyUsage=serverAuth",
                   "keyUsage=digitalSignature,keyEncipherment"]


@pytest.mark.parametrize("user", ["admin", "kube-controller-manager"])
def test_kubeconfig(tmp_path: Path, user: str):
    path = tmp_path / "kubeconfig"
    pki.write_kubeconfig(path, "https://127.0.0.1:1", tmp_path / "ca.crt", "tok", user=user)
    cfg = json.loads(path.read_text())
    assert path.stat().st_mode & 0o777 == 0o600
    assert cfg["clusters"][0]["cluster"] == {"server": "https://127.0.0.1:1",
                                             "certificate-authority": str(tmp_path / "ca.crt")}
    assert cfg["users"] == [{"name": user, "user": {"token": "tok"}}]
    assert cfg["contexts"][0]["context"]["user"] == user


def test_tokens_file_makes_one_admin(tmp_path: Path):
    pki.write_tokens(tmp_path / "tokens.csv", "tok")
    assert (tmp_path / "tokens.csv").read_text() == 'tok,admin,admin,"system:masters"\n'


@pytest.mark.process
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_make_pki_signs_a_serving_certificate_for_its_addresses(tmp_path: Path):
    pki.make_pki(tmp_path, ("10.213.0.1",))
    for name in ("ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "sa.key", "sa.pub"):
        assert (tmp_path / name).is_file(), name
    verify = subprocess.run(["openssl", "verify", "-CAfile", "ca.crt", "apiserver.crt"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr
    text = subprocess.run(["openssl", "x509", "-in", "apiserver.crt", "-noout", "-text"],
                          cwd=tmp_path, capture_output=True, text=True).stdout
    assert "IP Address:10.213.0.1" in text and "DNS:kubernetes.default.svc" in text
    before = (tmp_path / "apiserver.crt").read_bytes()
    pki.make_pki(tmp_path, ("10.213.0.1",))  # kept when already there
    assert (tmp_path / "apiserver.crt").read_bytes() == before
