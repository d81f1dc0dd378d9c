"""Throwaway TLS certificates for loopback tests, made by the openssl CLI."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.procs import require_binary


@dataclass
class TLSFiles:
    """A CA, a server certificate for 127.0.0.1 signed by it, a client certificate
    and an unrelated second CA (all PEM file paths)."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca_cert: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(
        [require_binary("openssl"), *args],
        cwd=cwd,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=60,
    )


def make_tls_files(directory: Path) -> TLSFiles:
    """Create a CA, a server certificate for IP:127.0.0.1, a client certificate and a second CA."""
    directory.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "other-ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.crt",
            "-days",
            "2",
            "-subj",
            f"/CN=rdzv-test-{ca}",
            cwd=directory,
        )
    ext = directory / "ext.cnf"
    ext.write_text(
        "[server]\nsubjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
        "[client]\nextendedKeyUsage=clientAuth\n"
    )
    for name, section in (("server", "server"), ("client", "client")):
        _openssl(
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=rdzv-test-{name}",
            cwd=directory,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-extensions",
            section,
            cwd=directory,
        )
    return TLSFiles(
        ca_cert=str(directory / "ca.crt"),
        server_cert=str(directory / "server.crt"),
        server_key=str(directory / "server.key"),
        client_cert=str(directory / "client.crt"),
        client_key=str(directory / "client.key"),
        other_ca_cert=str(directory / "other-ca.crt"),
    )
