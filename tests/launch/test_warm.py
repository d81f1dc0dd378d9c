"""Warm restarts: what a spare preloads, and a warm worker is started exactly as a cold one.

The end-to-end tests run ``rdzv run`` twice on the same probe worker
(``warm_probe.py``: attempt 0 exits 3, attempt 1 records everything it can
see of how it was started and ends as told), once with spares and once with
``--no-warm-restart``, and compare attempt 1's records, exit and error
file; a record's process start time tells a warm worker (started while
attempt 0 ran) from a cold one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rdzv.cli import build_parser, main
from rdzv.launch.warm import (
    ATTEMPT_KEYS,
    Plan,
    WarmSpares,
    check_module_names,
    plan_for,
    predicted_env,
)
from rdzv.launch.workers import WorkerSpec
from tests.launch.procs import agents, alive, finish, kill_pids
from tests.procs import ROOT, free_port, subprocess_env, wait_until

PROBE = str(Path(__file__).with_name("warm_probe.py"))


def codes(plan: Plan | None) -> list[str]:
    assert plan is not None
    return [step.code.lstrip("\n") for step in plan.steps]


def test_a_plan_is_the_scripts_leading_imports_on_their_own_lines(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        '"""Doc."""\n'
        "from __future__ import annotations\n"
        "import os, sys\n"
        "# a comment\n"
        "from torch.nn import (\n    Linear,\n)\n"
        "import numpy as np; import json\n"
        "os.environ['OMP_NUM_THREADS'] = '4'\n"
        "import torch\n"
    )
    plan = plan_for(["train.py", "--epochs", "3"], str(tmp_path))
    assert plan is not None
    assert codes(plan) == [
        '"""Doc."""',
        "import os, sys",
        "from torch.nn import (\n    Linear,\n)",
        "import numpy as np",
        "import json",
    ]
    assert [s.code.count("\n") - s.code.lstrip("\n").count("\n") + 1 for s in plan.steps] == [
        1,
        3,
        5,
        8,
        8,
    ]
    assert [s.tops for s in plan.steps] == [(), ("os", "sys"), ("torch",), ("numpy",), ("json",)]
    assert plan.path0 == str(tmp_path.resolve())
    assert plan.main_file == str(tmp_path / "train.py")
    assert {s.module for s in plan.steps} == {"__main__"}
    assert [path for path, _ in plan.digests] == [str(script)]


def test_a_plan_stops_at_a_relative_import_and_has_none_for_bad_source(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import os\nfrom . import sibling\nimport json\n")
    assert codes(plan_for(["a.py"], str(tmp_path))) == ["import os"]
    (tmp_path / "b.py").write_text("import os\ndef (:\n")
    plan = plan_for(["b.py"], str(tmp_path))
    assert plan is not None
    assert (plan.steps, plan.path0, [path for path, _ in plan.digests]) == (
        (),
        None,
        [str(tmp_path / "b.py")],
    )
    assert plan_for(["missing.py"], str(tmp_path)) == Plan()


def test_a_plan_of_a_module_goes_through_import_only_packages(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("import json\n")
    (package / "sub" / "__init__.py").write_text("import os\nVALUE = 1\nimport csv\n")
    (package / "sub" / "train.py").write_text("import torch\n")
    plan = plan_for(["-m", "pkg.sub.train", "x"], str(tmp_path))
    assert codes(plan) == ["import json", "import os"]
    assert plan is not None
    assert [s.module for s in plan.steps] == ["pkg", "pkg.sub"]
    assert plan.path0 == str(tmp_path)
    assert plan.main_file is None
    (package / "sub" / "__init__.py").write_text("import os\n")
    plan = plan_for(["-m", "pkg.sub.train"], str(tmp_path))
    assert codes(plan) == ["import json", "import os", "import torch"]
    assert plan is not None
    assert plan.steps[-1].module == "__main__"
    (package / "sub" / "train.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert plan_for(["-m", "pkg.sub.train"], str(tmp_path)) == Plan()
    assert plan_for(["-m", "json.tool"], str(tmp_path)) == Plan()


def test_interpreter_options_have_no_plan_and_c_has_only_the_extra_modules() -> None:
    assert plan_for(["-X", "importtime", "train.py"], "/") is None
    assert plan_for(["-I", "train.py"], "/") is None
    assert plan_for(["-c", "pass"], "/") == Plan()
    assert plan_for(["-c", "pass"], "/", ["torch._dynamo"]) == Plan("", extra=("torch._dynamo",))


def test_the_spare_environment_is_the_next_attempts_as_far_as_known() -> None:
    env = {
        "RANK": "3",
        "MASTER_PORT": "41234",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "PATH": "/bin",
    }
    assert predicted_env(env) == {**env, "MASTER_PORT": "0", "TORCHELASTIC_RESTART_COUNT": "2"}
    spent = {**env, "TORCHELASTIC_RESTART_COUNT": "3"}
    assert predicted_env(spent)["TORCHELASTIC_RESTART_COUNT"] == "3"
    assert {"RANK", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"} <= ATTEMPT_KEYS
    assert "PATH" not in ATTEMPT_KEYS
    assert "OMP_NUM_THREADS" not in ATTEMPT_KEYS


def test_module_names_are_checked() -> None:
    check_module_names(["torch._dynamo", "numpy"])
    with pytest.raises(ValueError, match="'torch-dynamo' is not a module name"):
        check_module_names(["torch-dynamo"])


def test_a_bad_warm_preload_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--standalone", "--warm-preload", "torch,torch-dynamo", PROBE]) == 2
    err = capsys.readouterr().err
    assert err == (
        "rdzv run: error: --warm-preload: 'torch-dynamo' is not a module name (e.g. torch._dynamo)\n"
    )
    parsed = build_parser().parse_args(["run", "--warm-preload", "a.b,c", "--no-warm-restart", "s"])
    assert (parsed.warm_preload, parsed.no_warm_restart) == (["a.b", "c"], True)


def test_no_spares_without_an_interpreter_binary(tmp_path: Path) -> None:
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    script = tmp_path / "w.py"
    script.write_text("pass\n")
    for python in (None, str(wrapper)):
        spares = WarmSpares(python, [str(script)])
        spares.prepare([WorkerSpec(0, 0, [str(wrapper), "-u", str(script)], {})])
        assert not spares._spares
        spares.close()


# --- real processes -------------------------------------------------------------


def site_dir(tmp_path: Path) -> Path:
    """A PYTHONPATH directory with a sitecustomize that changes the environment."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if 'TORCHELASTIC_RUN_ID' in os.environ:  # workers, not the agent\n"
        "    os.environ['PROBE_SITE'] = 'set by sitecustomize'\n"
        "    os.environ.pop('PROBE_GONE', None)\n"
    )
    return site


#: The probe as a script, and as a module (run from the checkout, the agents' directory).
ENTRIES = {"script": [PROBE], "module": ["-m", "tests.launch.warm_probe"]}


def run_probe(
    out: Path, entry: str, end: str, *options: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    out.mkdir()
    args = [
        "--rdzv-backend=static",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=probe",
        "--nnodes=1",
        "--max-restarts=1",
        "--monitor-interval=0.05",
        f"--log-dir={out / 'logs'}",
        "--log-level=INFO",
        *options,
        *ENTRIES[entry],
        str(out),
        end,
    ]
    with agents() as group:
        return finish(group.start(args, env=env), timeout=100)


def record(out: Path, attempt: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"probe-{attempt}.json").read_text())
    return data


def normalized(value: Any, out: Path, port: str) -> Any:
    text = json.dumps(value).replace(str(out), "OUT").replace(f'"{port}"', '"PORT"')
    return json.loads(text)


def compare(warm: Path, cold: Path) -> None:
    """Attempt 1's records are the same but for the pid, the agent's pid and the times."""
    records = []
    for out in (warm, cold):
        data = record(out, 1)
        assert data["ppid"] != os.getpid()  # the agent's child, not this test's
        port = dict(data["env"])["MASTER_PORT"]
        for key in ("pid", "ppid", "started", "observed"):
            del data[key]
        records.append(normalized(data, out, port))
    for key in records[0]:
        assert records[0][key] == records[1][key], key
    assert records[0] == records[1]


def warm_started(out: Path) -> bool:
    """Whether attempt 1's process started while attempt 0 ran (a spare), not after it."""
    return bool(record(out, 1)["started"] < record(out, 0)["observed"] + 0.3)


def last_line(err: str, out: Path) -> str:
    line = err.strip().splitlines()[-1].split(" rdzv run: ", 1)[1].replace(str(out), "OUT")
    return re.sub(r"pid \d+", "pid N", line)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("entry", "end", "outcome"),
    [
        ("script", "exit:7", "exited with code 7"),
        ("script", "kill:SIGTERM", "was killed by signal SIGTERM (15)"),
        ("script", "interrupt", "was killed by signal SIGINT (2)"),
        ("module", "exit:7", "exited with code 7"),
    ],
)
def test_a_warm_worker_is_started_exactly_as_a_cold_one(
    tmp_path: Path, entry: str, end: str, outcome: str
) -> None:
    env = subprocess_env(PROBE_GONE="removed by sitecustomize")
    env["PYTHONPATH"] = f"{site_dir(tmp_path)}{os.pathsep}{env['PYTHONPATH']}"
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    code, _, err = run_probe(warm, entry, end, env=env)
    cold_code, _, cold_err = run_probe(cold, entry, end, "--no-warm-restart", env=env)
    assert (code, cold_code) == (1, 1), err
    assert warm_started(warm), err
    assert not warm_started(cold), cold_err
    assert f"worker rank 0 starts warm (pid {record(warm, 1)['pid']})" in err
    assert "starts warm" not in cold_err
    assert outcome in last_line(err, warm)
    assert last_line(err, warm) == last_line(cold_err, cold)
    compare(warm, cold)
    data = record(warm, 1)
    env_seen = dict(data["env"])
    assert env_seen["PROBE_SITE"] == "set by sitecustomize"
    assert "PROBE_GONE" not in env_seen
    assert env_seen["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert "RDZV_WARM_FDS" not in env_seen
    assert env_seen["PYTHONPATH"] == env["PYTHONPATH"]
    assert data["name"] == "__main__"
    assert data["argv"] == [PROBE, str(warm), end]
    assert data["path"][0] == str(Path(PROBE).parent if entry == "script" else ROOT)
    assert data["death_signal"] == signal.SIGKILL
    assert data["session_leader"]
    assert data["group_leader"]
    assert "ctypes" in data["modules"]
    assert "sitecustomize" in data["modules"]
    assert "json" not in data["modules"]
    exits = [
        (out / "atexit-1.json").read_text() if end != "kill:SIGTERM" else "" for out in (warm, cold)
    ]
    assert exits[0] == exits[1]


@pytest.mark.slow
@pytest.mark.torch
def test_record_error_file_and_traceback_are_the_same_warm_and_cold(tmp_path: Path) -> None:
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    script = tmp_path / "failing.py"
    script.write_text(
        "import os\nimport sys\nimport time\n\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n\n\n"
        "@record\ndef main():\n"
        "    if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "        time.sleep(0.5)\n        sys.exit(3)\n"
        "    raise ValueError('bad input in ' + repr(sorted(sys.modules)))\n\n\n"
        "main()\n"
    )
    results = {}
    for out, options in ((warm, []), (cold, ["--no-warm-restart"])):
        out.mkdir()
        args = ["--standalone", "--max-restarts=1", f"--log-dir={out}", "--log-level=INFO"]
        with agents() as group:
            results[out] = finish(group.start([*args, *options, str(script)]), timeout=100)
    (code, _, err), (cold_code, _, cold_err) = results[warm], results[cold]
    assert (code, cold_code) == (1, 1), err
    assert "starts warm" in err
    assert "starts warm" not in cold_err
    files = {}
    for out in (warm, cold):
        [error_file] = out.glob("*/attempt_1/rank_0.error.json")
        [log] = out.glob("*/attempt_1/rank_0.log")
        data = json.loads(error_file.read_text())
        del data["message"]["extraInfo"]["timestamp"]
        files[out] = (data, log.read_text())
    assert files[warm] == files[cold]
    assert "ValueError: bad input in [" in files[warm][0]["message"]["message"]
    assert "'torch'" in files[warm][0]["message"]["message"]
    root = last_line(err, warm).split(": ", 2)[-1]
    assert "ValueError: bad input in" in root


@pytest.mark.slow
def test_a_changed_script_starts_cold_and_runs_the_new_text(tmp_path: Path) -> None:
    script = tmp_path / "edit.py"
    out = tmp_path / "out"
    out.mkdir()
    script.write_text(
        "import os\nimport sys\nimport time\nfrom pathlib import Path\n\n"
        "out = Path(sys.argv[1])\n"
        "(out / f'version-{os.environ[\"TORCHELASTIC_RESTART_COUNT\"]}').write_text('1')\n"
        "while not (out / 'edited').exists():\n    time.sleep(0.05)\n"
        "sys.exit(3)\n"
    )
    with agents() as group:
        proc = group.start(
            ["--standalone", "--max-restarts=1", "--log-level=INFO", str(script), str(out)]
        )
        wait_until((out / "version-0").exists, "attempt 0 to run")
        wait_until(lambda: spares_of(proc.pid), "the spare to start (it read the old text)")
        script.write_text(script.read_text().replace("write_text('1')", "write_text('2')"))
        (out / "edited").write_text("")
        code, _, err = finish(proc, timeout=60)
    assert code == 1
    assert (out / "version-1").read_text() == "2"
    assert "worker rank 0 starts cold: its spare: the script changed" in err


@pytest.mark.slow
def test_an_import_that_reads_an_attempt_variable_is_preloaded_only_when_it_is_right(
    tmp_path: Path,
) -> None:
    """A preloaded module that read MASTER_PORT makes a cold start; a local one is not preloaded."""
    lib = tmp_path / "lib"
    lib.mkdir()
    reader = "import os\nPORT = os.environ.get('MASTER_PORT')\nPID = os.getpid()\n"
    (lib / "installed_reader.py").write_text(reader)
    work = tmp_path / "work"
    work.mkdir()
    (work / "local_reader.py").write_text(reader)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("installed_reader", "local_reader"):
        (work / f"{name}_main.py").write_text(
            f"import json\nimport os\nimport sys\nimport time\nimport {name} as reader\n\n"
            "count = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
            "seen = {'import': reader.PORT, 'now': os.environ['MASTER_PORT'], 'pid': os.getpid()}\n"
            f"open(os.path.join(sys.argv[1], '{name}-' + count), 'w').write(json.dumps(seen))\n"
            "if count == '0':\n    time.sleep(0.5)\n    sys.exit(3)\n"
        )
    env = subprocess_env()
    env["PYTHONPATH"] = f"{lib}{os.pathsep}{env['PYTHONPATH']}"
    errs = {}
    for name in ("installed_reader", "local_reader"):
        with agents() as group:
            args = ["--standalone", "--max-restarts=1", "--log-level=INFO"]
            main = str(work / f"{name}_main.py")
            code, _, errs[name] = finish(group.start([*args, main, str(out)], env=env), 60)
        assert code == 0, errs[name]
        seen = json.loads((out / f"{name}-1").read_text())
        assert seen["import"] == seen["now"] != "0"
    assert "starts cold: its spare: its imports read MASTER_PORT" in errs["installed_reader"]
    assert "starts warm" in errs["local_reader"]


def spares_of(agent: int) -> list[int]:
    """The pids of an agent's spares: its children started with RDZV_WARM_FDS."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            initial = (entry / "environ").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == agent and b"\0RDZV_WARM_FDS=" in b"\0" + initial:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("how", ["finishes", "is SIGKILLed"])
def test_no_spare_outlives_its_agent(tmp_path: Path, how: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "wait.py"
    script.write_text(
        "import os\nimport sys\nimport time\n"
        "open(os.path.join(sys.argv[1], 'worker-' + str(os.getpid())), 'w').close()\n"
        "while not os.path.exists(os.path.join(sys.argv[1], 'release')):\n    time.sleep(0.05)\n"
    )
    spares: list[int] = []
    workers: list[int] = []
    try:
        with agents() as group:
            proc = group.start(["--standalone", "--max-restarts=2", str(script), str(out)])
            wait_until(lambda: list(out.glob("worker-*")), "the worker to start")
            spares = wait_until(lambda: spares_of(proc.pid), "a spare to start")
            workers = [int(p.name.split("-")[1]) for p in out.glob("worker-*")]
            assert set(spares).isdisjoint(workers)
            if how == "finishes":
                (out / "release").write_text("")
                code, _, err = finish(proc, timeout=60)
                assert code == 0, err
            else:
                proc.kill()
                finish(proc)
        wait_until(
            lambda: not any(alive(pid) for pid in [*spares, *workers]),
            "the spares and the worker to end",
            timeout=10,
        )
    finally:
        kill_pids([*spares, *workers])


def spare_run(
    tmp_path: Path, script_text: str, extra: tuple[str, ...] = ()
) -> tuple[list[int], int, int, str, str]:
    """Prepare a spare with WarmSpares itself, wait until it imported ``marker``, start a worker.

    ``marker`` (on PYTHONPATH) records the pid of each process importing it
    in ``tmp_path/marks``. Returns those pids (the spare's first), the
    worker's pid and exit status, and its stdout and stderr.
    """
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "marker.py").write_text(
        "import os\nopen(os.path.join(os.environ['MARKS'], str(os.getpid())), 'w').close()\n"
    )
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "main.py"
    script.write_text(script_text)
    env = subprocess_env(MARKS=str(marks))
    env["PYTHONPATH"] = f"{lib}{os.pathsep}{env['PYTHONPATH']}"
    argv = [sys.executable, "-u", str(script)]
    spares = WarmSpares(sys.executable, [str(script)], extra=extra, preload_delay=0)
    process: subprocess.Popen[bytes] | None = None
    try:
        spares.prepare([WorkerSpec(0, 0, argv, {**env, "RANK": "0"})])
        [spare] = spares._spares.values()
        wait_until(
            lambda: (marks / str(spare.process.pid)).exists() or spare.process.poll() is not None,
            "the spare to import marker, or to fail",
        )
        process = spares.start(WorkerSpec(5, 0, argv, {**env, "RANK": "5"}))
        out, err = process.communicate(timeout=30)
        others = sorted(int(p.name) for p in marks.iterdir() if p.name != str(spare.process.pid))
        imported = [spare.process.pid, *others]
        return imported, process.pid, process.returncode, out.decode(), err.decode()
    finally:
        spares.close()
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_a_spare_preloads_the_leading_imports_ahead_of_need_and_becomes_the_worker(
    tmp_path: Path,
) -> None:
    text = "import marker\nimport os\nprint('worker', os.getpid(), os.environ['RANK'])\n"
    imported, pid, code, out, err = spare_run(tmp_path, text)
    assert imported == [pid]
    assert (code, out) == (0, f"worker {pid} 5\n"), err


@pytest.mark.slow
def test_a_spare_preloads_the_extra_modules_and_skips_missing_ones(tmp_path: Path) -> None:
    text = "import os\nprint('worker', os.getpid())\nimport marker\n"
    imported, pid, code, out, err = spare_run(tmp_path, text, ("no_such_module.sub", "marker"))
    assert imported == [pid]
    assert (code, out) == (0, f"worker {pid}\n"), err


@pytest.mark.slow
def test_a_spare_whose_imports_fail_makes_a_cold_start_that_fails_the_same(
    tmp_path: Path,
) -> None:
    text = "import marker\nimport no_such_module\n"
    imported, pid, code, _, err = spare_run(tmp_path, text)
    assert imported[1:] == [pid]  # the spare imported marker, then a new process did
    assert code == 1
    assert "ModuleNotFoundError: No module named 'no_such_module'" in err
