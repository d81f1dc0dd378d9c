"""Packaging hygiene: one version source, the licence, ``python -m rdzv``, logging, docs."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from typing import Any

import pytest

import rdzv
from tests.procs import ROOT, subprocess_env


def pyproject() -> dict[str, Any]:
    """pyproject.toml, parsed; its callers are skipped before Python 3.11 (no tomllib)."""
    if sys.version_info >= (3, 11):  # mypy checks as 3.10 (python_version): it skips this
        import tomllib

        return tomllib.loads((ROOT / "pyproject.toml").read_text())
    raise AssertionError("tomllib is new in Python 3.11")


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is new in Python 3.11")
def test_the_version_is_written_once_and_pyproject_reads_it() -> None:
    project = pyproject()
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rdzv.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", rdzv.__version__)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is new in Python 3.11")
def test_the_licence_file_matches_the_metadata() -> None:
    project = pyproject()["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "the rdzv authors" in text


def test_python_dash_m_rdzv_is_the_command_line() -> None:
    done = run_python("-m", "rdzv", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"rdzv {rdzv.__version__}"
    done = run_python("-m", "rdzv", "backends")
    assert done.returncode == 0, done.stderr
    assert "c10d" in done.stdout


def test_the_library_leaves_logging_to_the_application() -> None:
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("rdzv").handlers)
    # Without the NullHandler, Python's last-resort handler prints a bare line.
    done = run_python(
        "-c", "import logging, rdzv; logging.getLogger('rdzv.dynamic').warning('leaked')"
    )
    assert done.returncode == 0
    assert done.stderr == ""


def test_the_setup_script_touches_no_system_service() -> None:
    for script in ("scripts/setup", "scripts/test"):
        code = [
            line
            for line in (ROOT / script).read_text().splitlines()
            if not line.lstrip().startswith("#")
        ]
        text = "\n".join(code)
        for word in ("init.d", "systemctl", "service ", "invoke-rc.d", "policy-rc.d"):
            assert word not in text, f"{script} mentions {word!r}"


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_install_from_the_source_tree_with_quoted_extras(doc: object) -> None:
    from pathlib import Path

    assert isinstance(doc, Path)
    for line in doc.read_text().splitlines():
        for found in re.findall(r"pip install [^`|;&#]*", line):
            # rdzv is not on PyPI, and zsh expands unquoted brackets.
            words = found.split()[2:]
            assert not any(re.match(r"['\"]?rdzv(\[|$)", w) for w in words), line
            for word in words:
                if "[" in word:
                    assert word[0] in "'\"", f"unquoted extras in {doc.name}: {line}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_say_pytest_needs_the_dev_extra(doc: object) -> None:
    from pathlib import Path

    assert isinstance(doc, Path)
    text = doc.read_text()
    if "python -m pytest" in text:
        assert "'.[dev" in text, f"{doc.name} runs pytest without naming the dev extra"
