"""Every shell command of README.md and docs/*.md runs as written, or says why it cannot here.

Commands live in fenced ``sh`` blocks. A plain ``sh`` block runs, in
document order, as one bash script (``set -e``) in a fresh copy of the tree
(its tracked files) with a fresh virtual environment first on ``PATH``
(``--system-site-packages``, so the installed torch is visible) into which
the copy was installed with ``pip install .``. A block that cannot run here
names the reason in its info string: ``skip-hosts`` (machines or a
scheduler that do not exist here), ``skip-long`` (minutes: the test suite,
benchmarks, the chaos harness) or ``skip-synopsis`` (placeholders). A
command anywhere else (an indented block, another fence) fails the test, so
none escapes it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REASONS = ("skip-hosts", "skip-long", "skip-synopsis")

# A line that starts a shell command (not output such as "rdzv run: ...").
_COMMAND = re.compile(
    r"(?:[A-Z_]+=\S*\s+)*(?:rdzv|python3?|pip|bash|torchrun|curl|srun|sbatch|kubectl|export)"
    r"(?:\s+(?!\S*:\s)\S|$)"
)
_FENCE = re.compile(r"(`{3,})(.*)")


@dataclass(frozen=True)
class Block:
    """A code block of a Markdown file."""

    path: Path
    line: int
    info: str | None  # None: an indented block
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> Iterator[Block]:
    """Yield the fenced and indented code blocks of a Markdown file."""
    lines = path.read_text().split("\n")
    i = 0
    previous_blank = True
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.fullmatch(line.strip())
        if fence is not None and not line.startswith("    "):
            end = next(
                (j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1)),
                len(lines),
            )
            yield Block(path, i + 1, fence.group(2).strip(), "\n".join(lines[i + 1 : end]))
            i, previous_blank = end + 1, False
            continue
        if previous_blank and line.startswith("    ") and line.strip():
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            body = [entry[4:] for entry in lines[i:end]]
            yield Block(path, i + 1, None, "\n".join(body).strip("\n"))
            i, previous_blank = end, False
            continue
        previous_blank = not line.strip()
        i += 1


def all_blocks() -> list[Block]:
    return [block for path in DOCS for block in blocks(path)]


def has_command(text: str) -> bool:
    return any(_COMMAND.match(line.strip()) for line in text.split("\n"))


def test_the_block_reader_finds_fenced_and_indented_blocks(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Text\n\n```sh skip-hosts\nrdzv run x\n```\n\n    rdzv --version\n    more\n\nEnd\n"
    )
    found = list(blocks(doc))
    assert [(b.line, b.info, b.text) for b in found] == [
        (3, "sh skip-hosts", "rdzv run x"),
        (7, None, "rdzv --version\nmore"),
    ]
    assert has_command("rdzv backends")
    assert has_command("PYTHONPATH=src python x.py")
    assert not has_command("rdzv run: run 'job42' failed")
    assert not has_command("2030-01-31 12:00:00.123 rdzv run: node 0/2 starting")


def test_commands_are_only_in_sh_blocks() -> None:
    stray = [
        b.where
        for b in all_blocks()
        if not (b.info or "").startswith("sh")
        and not (b.info or "").startswith(("python", "yaml"))
        and has_command(b.text)
    ]
    assert stray == [], "put these commands in a fenced sh block"


def test_every_sh_block_runs_or_says_why() -> None:
    sh = [b for b in all_blocks() if (b.info or "").split()[:1] == ["sh"]]
    assert sh
    bad = [b.where for b in sh if b.info not in ("sh", *(f"sh {r}" for r in REASONS))]
    assert bad == [], f"info strings must be 'sh' or 'sh <reason>' with a reason of {REASONS}"


RUNNABLE = [b for b in all_blocks() if b.info == "sh"]


@pytest.fixture(scope="module")
def fresh_checkout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A copy of the tree's tracked files and a venv with it installed: (directory, env)."""
    base = tmp_path_factory.mktemp("doc-commands")
    tree = base / "rdzv"
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = tree / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    venv = base / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
        check=True,
        timeout=120,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    install = subprocess.run(
        ["pip", "install", "-q", "."],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert install.returncode == 0, install.stderr
    where = subprocess.run(
        ["python", "-c", "import rdzv; print(rdzv.__file__)"],
        cwd=base,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert where.stdout.startswith(str(venv)), where.stdout  # not another tree's rdzv
    return tree, env


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.xdist_group("doc-commands")  # one worker builds the fresh checkout, once
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_doc_block_runs_as_written(
    block: Block, fresh_checkout: tuple[Path, dict[str, str]]
) -> None:
    tree, env = fresh_checkout
    done = subprocess.run(
        ["bash", "-e", "-c", block.text],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"{block.where}:\n{block.text}\n{done.stdout}\n{done.stderr}"
    rdzv = shutil.which("rdzv", path=env["PATH"])
    assert rdzv is not None
    assert rdzv.startswith(env["VIRTUAL_ENV"])


def test_blocks_that_cannot_run_here_are_valid_shell() -> None:
    skipped = [b for b in all_blocks() if (b.info or "").startswith("sh skip-")]
    bad = []
    for block in skipped:
        done = subprocess.run(
            ["bash", "-n", "-c", block.text],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            bad.append(f"{block.where}: {done.stderr.strip()}")
    assert bad == []


def test_yaml_blocks_parse() -> None:
    yaml = pytest.importorskip("yaml")
    found = [b for b in all_blocks() if b.info == "yaml"]
    assert found
    for block in found:
        documents = [d for d in yaml.safe_load_all(block.text) if d is not None]
        assert documents, block.where
        assert all(isinstance(d, dict) and "kind" in d for d in documents), block.where
