"""Where the TCP store's shared secret comes from: a file or the environment.

A secret given on a command line is visible to every user of the machine
(``ps``, ``/proc/PID/cmdline``), so rdzv's commands and rendezvous settings
never take the secret itself: they take the path of a file holding it, or read
it from the :data:`AUTH_TOKEN_ENV` environment variable (which only the
process's own user can read from ``/proc``). A file wins over the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

__all__ = ["AUTH_TOKEN_ENV", "read_token_file", "resolve_auth_token"]

AUTH_TOKEN_ENV: Final = "RDZV_AUTH_TOKEN"  # noqa: S105 - a variable name, not a secret
"""The environment variable holding the shared secret when no file is given."""


def read_token_file(path: str | os.PathLike[str]) -> bytes:
    """Read a shared secret from a file, stripping surrounding whitespace.

    Raises:
        OSError: The file cannot be read.
        ValueError: The file holds nothing but whitespace.
    """
    token = Path(path).read_bytes().strip()
    if not token:
        raise ValueError(f"the auth token file {os.fspath(path)!r} is empty")
    return token


def resolve_auth_token(
    token_file: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None
) -> bytes | None:
    """Return the shared secret from ``token_file``, else from the environment.

    Args:
        token_file: A file holding the secret, or None.
        environ: The environment to read :data:`AUTH_TOKEN_ENV` from
            (``os.environ`` by default).

    Returns:
        The secret, or None when neither source gives one (an empty variable
        counts as unset).

    Raises:
        OSError: ``token_file`` cannot be read.
        ValueError: ``token_file`` is empty.
    """
    if token_file is not None and os.fspath(token_file) != "":
        return read_token_file(token_file)
    value = (os.environ if environ is None else environ).get(AUTH_TOKEN_ENV, "").strip()
    return value.encode() if value else None
