"""A worker for launcher tests: ``worker.py OUTDIR MODE [ARGS...]``.

Every mode first records the worker's environment in
``OUTDIR/env-<RANK>-<pid>.json`` and prints a few lines. Modes:

* ``ok``: exit 0.
* ``fail-once RANK CODE``: worker RANK exits CODE the first time (a marker
  file remembers), everyone else exits 0.
* ``fail RANK CODE``: worker RANK always exits CODE; the others sleep until stopped.
* ``signal RANK SIGNUM``: worker RANK kills itself with SIGNUM; the others sleep.
* ``kill-peer RANK SIGNUM``: once every worker of the attempt (same ``MASTER_PORT``)
  started, worker RANK kills itself with SIGNUM; the others exit 1 two seconds
  after it died, as a collective that lost a peer would.
* ``kill-peer-once RANK SIGNUM``: the same in the first attempt (a marker file
  remembers), then every worker exits 0.
* ``sleep``: sleep until stopped.
* ``sleep-once``: sleep until stopped the first time (a marker per rank), then exit 0.
* ``partial``: print a last line without a newline.
* ``wait-release``: sleep until the test creates ``OUTDIR/release-<WORLD_SIZE>``, then exit 0.
* ``stdin``: write the first line read from stdin to ``OUTDIR/stdin-<RANK>``, then exit 0.
* ``signals``: wait for SIGTERM, SIGINT, SIGHUP, SIGQUIT or SIGUSR1, write its name to
  ``OUTDIR/signal-<RANK>``, then exit 0.
* ``env``: also record the whole environment and the interpreter's command line in
  ``OUTDIR/fullenv-<RANK>.json``, exit 0.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

KEYS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "CUDA_VISIBLE_DEVICES",
]


def sleep_forever() -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(99)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers never see a partial file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def wait_for_peers(outdir: Path) -> None:
    """Wait until every worker of this attempt has written its record."""
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # Records are written atomically: a file that exists is whole.
        records = [json.loads(p.read_text()) for p in outdir.glob("env-*.json")]
        if sum(r["TORCHELASTIC_RESTART_COUNT"] == restart for r in records) >= world:
            return
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Tell whether a process runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def kill_peer(outdir: Path, rank: int, target: int, signum: int, once: bool) -> None:
    marker = outdir / "killed-once"
    port = os.environ["MASTER_PORT"]
    if once and marker.exists() and marker.read_text() != port:
        sys.exit(0)
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + 30
    peers: dict[int, int] = {}
    while len(peers) < world and time.monotonic() < deadline:
        records = [json.loads(p.read_text()) for p in outdir.glob("env-*.json")]
        peers = {int(r["RANK"]): r["pid"] for r in records if r["MASTER_PORT"] == port}
        time.sleep(0.02)
    if rank == target:
        write_atomically(marker, port)
        os.kill(os.getpid(), signum)
    while alive(peers.get(target, 0)) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(2.0)
    sys.exit(1)


def main() -> None:
    out, mode, *rest = sys.argv[1:]
    outdir = Path(out)
    rank = int(os.environ["RANK"])
    record: dict[str, object] = {key: os.environ.get(key) for key in KEYS}
    record["pid"] = os.getpid()
    write_atomically(outdir / f"env-{rank}-{os.getpid()}.json", json.dumps(record))
    for i in range(3):
        print(f"line {i} from rank {rank}")
    print(f"err line from rank {rank}", file=sys.stderr)
    sys.stdout.flush()
    if mode == "ok":
        return
    if mode == "env":
        full = {"env": dict(os.environ), "argv": sys.orig_argv}
        write_atomically(outdir / f"fullenv-{rank}.json", json.dumps(full))
        return
    if mode == "stdin":
        (outdir / f"stdin-{rank}").write_text(sys.stdin.readline())
        return
    if mode == "signals":
        got: list[str] = []
        for signum in (
            signal.SIGTERM,
            signal.SIGINT,
            signal.SIGHUP,
            signal.SIGQUIT,
            signal.SIGUSR1,
        ):
            signal.signal(signum, lambda n, _f: got.append(signal.Signals(n).name))
        (outdir / f"ready-{rank}").write_text("x")
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        (outdir / f"signal-{rank}").write_text(",".join(got))
        return
    if mode == "partial":
        sys.stdout.write("no newline at the end")
        return
    if mode == "sleep":
        sleep_forever()
    if mode == "wait-release":
        release = outdir / f"release-{os.environ['WORLD_SIZE']}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if release.exists():
                return
            time.sleep(0.05)
        sys.exit(98)
    if mode == "sleep-once":
        marker = outdir / f"slept-{rank}"
        if not marker.exists():
            marker.write_text("x")
            sleep_forever()
        return
    target = int(rest[0])
    if mode in ("kill-peer", "kill-peer-once"):
        kill_peer(outdir, rank, target, int(rest[1]), once=mode == "kill-peer-once")
    if mode == "fail-once":
        marker = outdir / "failed-once"
        if rank == target and not marker.exists():
            wait_for_peers(outdir)
            marker.write_text("x")
            sys.exit(int(rest[1]))
        return
    if rank != target:
        sleep_forever()
    if mode == "fail":
        wait_for_peers(outdir)
        sys.exit(int(rest[1]))
    if mode == "signal":
        wait_for_peers(outdir)
        os.kill(os.getpid(), int(rest[1]))
        sleep_forever()
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
