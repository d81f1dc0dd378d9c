"""Which variables native code reads with ``getenv`` while modules are imported.

A warm spare imports a worker's modules before the attempt's environment is
known; the variables that may still change (``rdzv.launch.warm.ATTEMPT_KEYS``)
must not be read on import. Python code's reads are seen by the spare itself;
this checks the native libraries' reads: it compiles a small ``getenv`` /
``secure_getenv`` interposer with ``cc``, runs ``python -c "import MODULES"``
under ``LD_PRELOAD`` and prints every name read, and which of them are
per-attempt variables (none is the answer the warm restarts rely on).

    python benchmarks/warm_getenv.py [--modules torch,torch.distributed,torch.nn.parallel]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import subprocess_env
from rdzv.launch.warm import ATTEMPT_KEYS

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
static void note(const char *name) {
    char line[512];
    int n = snprintf(line, sizeof line, "GETENV %s\n", name);
    if (n > 0) write(2, line, n < (int)sizeof line ? n : (int)sizeof line - 1);
}
char *getenv(const char *name) {
    static char *(*real)(const char *);
    if (!real) real = dlsym(RTLD_NEXT, "getenv");
    note(name);
    return real(name);
}
char *secure_getenv(const char *name) {
    static char *(*real)(const char *);
    if (!real) real = dlsym(RTLD_NEXT, "secure_getenv");
    note(name);
    return real(name);
}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modules", default="torch,torch.distributed,torch.nn.parallel")
    args = parser.parse_args()
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        source, shim = Path(tmp, "getenv.c"), Path(tmp, "getenv.so")
        source.write_text(SHIM)
        subprocess.run([compiler, "-shared", "-fPIC", "-o", shim, source, "-ldl"], check=True)
        done = subprocess.run(
            [sys.executable, "-c", f"import {args.modules}"],
            env=subprocess_env(LD_PRELOAD=str(shim)),
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"the import failed:\n{done.stderr[-2000:]}")
    names = sorted({line[7:] for line in done.stderr.splitlines() if line.startswith("GETENV ")})
    print(f"import {args.modules}: {len(names)} variables read with getenv:")
    print(" ".join(names))
    print(f"per-attempt variables among them: {sorted(set(names) & ATTEMPT_KEYS) or 'none'}")


if __name__ == "__main__":
    main()
