"""Self-signed TLS certificates for loopback tests, made by the openssl CLI."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed_certificate(folder: Path, name: str = "store") -> tuple[Path, Path]:
    """Write a self-signed certificate for 127.0.0.1 and its key into ``folder``.

    Args:
        folder: Where the files go.
        name: The files' stem (``<name>-cert.pem``, ``<name>-key.pem``).

    Returns:
        ``(certificate, key)``: the certificate is its own CA bundle.
    """
    cert, key = folder / f"{name}-cert.pem", folder / f"{name}-key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key
