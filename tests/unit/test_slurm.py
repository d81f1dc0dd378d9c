"""SLURM's compressed host lists and the rdzv run settings its variables give."""

from __future__ import annotations

import pytest

from rdzv.launch.slurm import expand_nodelist, slurm_settings


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("gpu[8-10]-ib", ["gpu8-ib", "gpu9-ib", "gpu10-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("n[007-009]", ["n007", "n008", "n009"]),
        ("x[5]", ["x5"]),
        (" h1,h2 ", ["h1", "h2"]),
    ],
)
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty host name"),
        ("a,,b", "empty host name"),
        ("node[1-", "without ']'"),
        ("node1-]", "without '\\['"),
        ("node[[1]]", "nested"),
        ("node[3-1]", "A <= B"),
        ("node[a-b]", "not a number"),
        ("node[]", "not a number"),
    ],
)
def test_a_bad_nodelist_names_the_variable(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as raised:
        expand_nodelist(text, "SLURM_NODELIST")
    assert str(raised.value).startswith("SLURM_NODELIST=")


def test_slurm_settings_from_an_allocation() -> None:
    env = {
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "gpu[03-05,09]",
    }
    assert slurm_settings(env) == {
        "nnodes": ("4", "SLURM_NNODES"),
        "node_rank": ("2", "SLURM_NODEID"),
        "rdzv_id": ("123456", "SLURM_JOB_ID"),
        "rdzv_endpoint": ("gpu03:29400", "SLURM_JOB_NODELIST"),
    }


def test_slurm_settings_fall_back_to_the_older_names_and_are_empty_outside_slurm() -> None:
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOBID": "7", "SLURM_NODELIST": "h1,h2"}
    assert slurm_settings(env) == {
        "nnodes": ("2", "SLURM_JOB_NUM_NODES"),
        "rdzv_id": ("7", "SLURM_JOBID"),
        "rdzv_endpoint": ("h1:29400", "SLURM_NODELIST"),
    }
    assert slurm_settings({"HOME": "/root"}) == {}


def test_a_bad_count_names_the_variable() -> None:
    with pytest.raises(ValueError, match="SLURM_NODEID='x' is not a non-negative integer"):
        slurm_settings({"SLURM_NODEID": "x"})
