"""An agent stand-in with a busy gRPC client: ``grpc_spawner.py ENDPOINT COUNT [--preexec]``.

Four threads put and read keys through rdzv's gRPC etcd client at
``ENDPOINT`` (``host:port``) without pause while the main thread starts
``/bin/true`` COUNT times, one after the other, through
:func:`rdzv.launch.workers.start_process` (or, with ``--preexec``, the way
workers were started before: ``subprocess.Popen`` with a ``preexec_fn``
that asks for the death signal). It prints one JSON line:
``{"started": N, "failed": [[returncode, last stderr bytes], ...], "calls": C}``
(``calls``: the gRPC calls the threads made meanwhile).
"""

import ctypes
import json
import signal
import subprocess
import sys
import threading

from rdzv.backends.etcd.grpc import EtcdGrpcClient
from rdzv.errors import RendezvousError
from rdzv.launch.workers import start_process

THREADS = 4


def preexec_start() -> "subprocess.Popen[bytes]":
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_death_signal() -> None:
        prctl(1, int(signal.SIGKILL))

    return subprocess.Popen(
        ["/bin/true"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=set_death_signal,  # noqa: PLW1509 - the old way, for comparison
    )


def main() -> None:
    endpoint, count = sys.argv[1], int(sys.argv[2])
    preexec = "--preexec" in sys.argv[3:]
    host, _, port = endpoint.rpartition(":")
    client = EtcdGrpcClient([(host, int(port))])
    stop = threading.Event()
    calls = [0] * THREADS

    def hammer(index: int) -> None:
        key = b"/grpc-spawner/%d" % index
        while not stop.is_set():
            try:
                client.put(key, b"v")
                client.range(key)
            except RendezvousError:
                continue
            calls[index] += 2

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    failed = []
    try:
        while sum(calls) < 20:
            stop.wait(0.01)
        for _ in range(count):
            if preexec:
                process = preexec_start()
            else:
                process = start_process(["/bin/true"], {"PATH": "/usr/bin:/bin"})
            _, err = process.communicate(timeout=60)
            if process.returncode != 0:
                failed.append([process.returncode, err[-200:].decode(errors="replace")])
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        client.close()
    print(json.dumps({"started": count, "failed": failed, "calls": sum(calls)}))


if __name__ == "__main__":
    main()
