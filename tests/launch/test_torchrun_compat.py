"""``rdzv run`` accepts torchrun 2.13's options and ``PET_*`` variables with torchrun's meaning.

The option tests walk torchrun's own parser (``torch.distributed.run``), so an
option torchrun adds and ``rdzv run`` lacks fails here.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from rdzv.api import RendezvousParameters, RendezvousSettings
from rdzv.backends.options import EtcdOptions, RedisOptions, StoreBackendOptions
from rdzv.cli import build_parser, main
from rdzv.launch import nproc as rdzv_nproc
from rdzv.launch import options as rdzv_options
from rdzv.launch.run import known_conf_keys
from rdzv.registry import BACKEND_FACTORIES
from tests.launch.procs import WORKER

pytestmark = pytest.mark.torch

torch_run = pytest.importorskip("torch.distributed.run")

# A valid value for every option of torchrun that takes one, by destination.
SAMPLES: dict[str, str] = {
    "nnodes": "2:3",
    "nproc_per_node": "3",
    "rdzv_backend": "etcd",
    "rdzv_endpoint": "h:1",
    "rdzv_id": "job7",
    "rdzv_conf": "join_timeout=9",
    "max_restarts": "2",
    "monitor_interval": "0.5",
    "start_method": "fork",
    "event_log_handler": "console",
    "role": "trainer",
    "log_dir": "/tmp/logs",
    "redirects": "0:1,1:2",
    "tee": "3",
    "local_ranks_filter": "0,1",
    "duplicate_stdout_filters": "loss,,acc,step",
    "duplicate_stderr_filters": "error",
    "node_rank": "1",
    "master_addr": "10.0.0.1",
    "master_port": "1234",
    "local_addr": "10.0.0.2",
    "logs_specs": "custom",
    "numa_binding": "socket",
    "signals_to_handle": "SIGTERM,SIGUSR1",
    "shutdown_timeout": "7",
}

ARGS = ["train.py", "--lr", "1"]


def torch_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = torch_run.get_args_parser()
    return parser


def rdzv_run_parser() -> argparse.ArgumentParser:
    run: argparse.ArgumentParser = build_parser().parse_args(["run", "x"]).command_parser
    return run


def torch_options() -> list[argparse.Action]:
    return [a for a in torch_parser()._actions if a.option_strings and a.dest != "help"]


def parse_both(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    return torch_parser().parse_args(argv), rdzv_run_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("option", "action"),
    [(o, a) for a in torch_options() for o in a.option_strings],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_every_torchrun_option_parses_to_the_same_value(option: str, action: Any) -> None:
    if action.nargs == 0:
        argv = [option, *ARGS]
    else:
        assert action.dest in SAMPLES, f"torchrun's {option} needs a sample value in this test"
        values = action.choices or [SAMPLES[action.dest]]
        for value in values:
            theirs, ours = parse_both([option, str(value), *ARGS])
            assert getattr(ours, action.dest) == getattr(theirs, action.dest), value
        return
    theirs, ours = parse_both(argv)
    assert getattr(ours, action.dest) == getattr(theirs, action.dest)
    assert (ours.training_script, ours.training_script_args) == ("train.py", ["--lr", "1"])


def test_every_choice_of_torchrun_is_accepted() -> None:
    ours = {a.dest: a for a in rdzv_run_parser()._actions}
    for action in torch_options():
        if action.choices is not None:
            assert set(ours[action.dest].choices or ()) == set(action.choices), action.dest


ENV_ACTIONS = (torch_run.env, torch_run.check_env)


@pytest.mark.parametrize(
    "action",
    [a for a in torch_options() if isinstance(a, ENV_ACTIONS)],
    ids=lambda a: f"PET_{a.dest.upper()}",
)
def test_every_pet_variable_torchrun_reads_is_read(
    action: argparse.Action, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = "1" if action.nargs == 0 else SAMPLES[action.dest]
    monkeypatch.setenv(f"PET_{action.dest.upper()}", value)
    theirs, ours = parse_both(ARGS)
    assert getattr(ours, action.dest) == getattr(theirs, action.dest)
    assert getattr(ours, action.dest) not in (None, False, "", [])
    if action.nargs != 0 and action.type in (None, str) and not action.choices:
        # The command line wins over the environment, as in torchrun.
        theirs, ours = parse_both([action.option_strings[-1], "from-argv", *ARGS])
        assert getattr(ours, action.dest) == getattr(theirs, action.dest) == "from-argv"


def test_a_bad_pet_flag_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PET_STANDALONE", "yes")
    assert main(["run", WORKER]) == 2
    assert "PET_STANDALONE='yes' is not an integer (0 or 1)" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["cpu", "auto", "gpu", "xpu", "3"])
def test_nproc_per_node_is_decided_as_torchrun_decides(value: str) -> None:
    try:
        expected = torch_run.determine_local_world_size(value)
    except ValueError:
        with pytest.raises(rdzv_options.RunOptionsError, match=f"--nproc-per-node {value}: "):
            rdzv_nproc.local_world_size(value)
        return
    assert rdzv_nproc.local_world_size(value) == expected


def test_an_unrecognised_option_prints_the_usage_of_rdzv_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--no-such-option", "train.py"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rdzv run ")
    assert "rdzv run: error: unrecognized arguments: --no-such-option" in err


class Recording(RendezvousParameters):
    """Parameters that remember every configuration key read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


@pytest.mark.parametrize(
    ("parse", "keys", "endpoint"),
    [
        (StoreBackendOptions.from_params, StoreBackendOptions.KEYS, "h:1"),
        (EtcdOptions.from_params, EtcdOptions.KEYS, "h:1"),
        (RedisOptions.from_params, RedisOptions.KEYS, "h:1"),
        (RendezvousSettings.from_params, RendezvousSettings.KEYS, "h:1"),
    ],
    ids=["store", "etcd", "redis", "settings"],
)
def test_the_known_keys_are_the_keys_read(parse: Any, keys: frozenset[str], endpoint: str) -> None:
    params = Recording("c10d", endpoint, "run", 1, 1)
    parse(params)
    assert params.read == keys


def test_every_built_in_dynamic_backend_knows_its_keys() -> None:
    for name in BACKEND_FACTORIES:
        known = known_conf_keys(name)
        assert known is not None, name
        assert known >= RendezvousSettings.KEYS
    assert known_conf_keys("static") is None
    assert known_conf_keys("some-plugin") is None
