"""torchrun's stream choices (``-r``, ``-t``, ``--local-ranks-filter``) and error files, in-process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rdzv.launch import AgentConfig
from rdzv.launch.exits import read_root_cause
from rdzv.launch.options import comma_separated_list, parse_local_ranks_filter, parse_signals
from rdzv.launch.workers import Std, StdChoice


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", StdChoice(Std.NONE)),
        ("3", StdChoice(Std.ALL)),
        ("0:1,1:2", StdChoice(Std.NONE, {0: Std.OUT, 1: Std.ERR})),
    ],
)
def test_std_choice_reads_torchruns_format(text: str, expected: StdChoice) -> None:
    assert StdChoice.parse(text) == expected


@pytest.mark.parametrize("text", ["4", "", "a", "0:", "0:4", ":1", "0:1,", "1,2"])
def test_std_choice_rejects_other_text(text: str) -> None:
    with pytest.raises(ValueError, match="neither 0-3 nor LOCAL_RANK:0-3"):
        StdChoice.parse(text)


def config(**kwargs: Any) -> AgentConfig:
    return AgentConfig(["w.py"], nproc_per_node=3, log_dir=Path("logs"), **kwargs)


def test_console_streams_follow_redirects_tee_and_the_filter() -> None:
    assert [config().console(r) for r in range(3)] == [Std.ALL] * 3
    redirected = config(redirects=StdChoice(Std.ALL), tee=StdChoice.parse("0:1,2:3"))
    assert [redirected.console(r) for r in range(3)] == [Std.OUT, Std.NONE, Std.ALL]
    filtered = config(redirects=StdChoice.parse("1:2"), local_ranks_filter=frozenset({1}))
    assert [filtered.console(r) for r in range(3)] == [Std.NONE, Std.OUT, Std.NONE]


def test_files_need_a_log_dir() -> None:
    cases: list[dict[str, Any]] = [
        {"redirects": StdChoice(Std.OUT)},
        {"tee": StdChoice.parse("0:2")},
        {"duplicate_stdout_filters": ["x"]},
    ]
    for kwargs in cases:
        with pytest.raises(ValueError, match="give log_dir"):
            AgentConfig(["w.py"], **kwargs)


def test_small_parsers() -> None:
    assert comma_separated_list("a,,b,c") == ["a,b", "c"]
    assert parse_local_ranks_filter("") is None
    assert parse_local_ranks_filter("2,0") == frozenset({0, 2})
    assert [s.name for s in parse_signals("SIGUSR1, SIGTERM,SIGUSR1")] == ["SIGUSR1", "SIGTERM"]


def write(path: Path, data: object) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_root_cause_of_torchs_error_file(tmp_path: Path) -> None:
    stack = (
        'Traceback (most recent call last):\n  File "/a/train.py", line 3, in main\n'
        '    f()\n  File "/a/lib.py", line 9, in f\n    raise KeyError\n'
    )
    data = {"message": {"message": "KeyError: 'x'", "extraInfo": {"py_callstack": stack}}}
    cause = read_root_cause(write(tmp_path / "e.json", data))
    assert cause == "KeyError: 'x' (at /a/lib.py:9 in f)"
    assert read_root_cause(write(tmp_path / "s.json", {"message": "Signal 6"})) == "Signal 6"
    odd = {"message": {"message": "E: x", "extraInfo": ["not", "a", "dict"]}}
    assert read_root_cause(write(tmp_path / "o.json", odd)) == "E: x"


@pytest.mark.parametrize(
    "content",
    [
        "",
        "not json",
        "[]",
        '{"message": 3}',
        '{"message": {"message": ""}}',
        '{"x": 1}',
        '{"message": {"message": 7, "extraInfo": []}}',
    ],
)
def test_a_missing_or_malformed_error_file_gives_no_root_cause(
    tmp_path: Path, content: str
) -> None:
    assert read_root_cause(write(tmp_path / "e.json", content)) is None
    assert read_root_cause(tmp_path / "missing.json") is None


def test_a_root_cause_is_one_bounded_line_without_control_characters(tmp_path: Path) -> None:
    data = {"message": {"message": "E: \x1b[31mred\x07 " + "x" * 1000 + "\nsecond line"}}
    cause = read_root_cause(write(tmp_path / "e.json", data))
    assert cause is not None
    assert "\x1b" not in cause
    assert "\\x1b[31mred\\x07" in cause
    assert len(cause) <= 300
    assert cause.endswith("...")
