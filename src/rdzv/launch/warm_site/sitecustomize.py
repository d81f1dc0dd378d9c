"""The inside of a warm spare: preload, wait for "go", then let Python run the worker.

Theory of operation. A warm spare is started with exactly a cold worker's
command line (``python -u script.py args``), with this directory in front of
``PYTHONPATH`` and ``RDZV_WARM_FDS`` naming two pipes to the agent. Python
imports this module from ``site``, before it runs the script, and this module:

1. takes itself out of the way: the variable, this directory in ``sys.path``
   and ``sys.modules["sitecustomize"]``; reads the agent's first message (the
   real ``PYTHONPATH``, the script's ``sys.path[0]``, the statements to
   preload), restores ``PYTHONPATH``; the modules it imported for that
   (``json``) leave ``sys.modules`` again;
2. runs the real ``sitecustomize`` and ``usercustomize`` as ``site`` would
   have, then the leading import statements of the script, compiled from the
   script's own text with its file name and line numbers, in ``__main__``
   (with ``__file__``, ``__cached__`` and ``__loader__`` as Python sets them
   for a script, removed again afterwards, since Python adds them itself) and
   with ``sys.path[0]`` as the script will have it. It stops before the first
   statement whose module would come from the script's own directory: local
   code runs only after "go". Then the modules listed with ``--warm-preload``.
   Reads of ``os.environ`` meanwhile are recorded;
3. tells the agent it is ready (the variables read, whether the environment
   was listed, the files of the modules it imported), and blocks;
4. on "go" replaces the whole environment with the attempt's (with the
   changes the preload itself made to the variables, as a cold start would
   have them), changes to the attempt's working directory (unless the
   preload changed directory), acknowledges, closes both pipes and returns:
   Python goes on exactly as for a cold start (``sys.argv``, ``sys.path[0]``,
   ``__main__``, tracebacks, exit status are all Python's own).

Anything unexpected before "go" ends the process at once with status 86,
never running the script: the agent then starts that worker cold. This
module imports only the standard library and never rdzv (the worker's
interpreter need not have rdzv installed), and no ``__future__`` (which
would stay in ``sys.modules``); its annotations are strings, so that any
Python 3 can read it: a module that does not load would let Python run the
script before "go".
"""

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_FDS_VARIABLE = "RDZV_WARM_FDS"
_FAILED = 86
_MESSAGE_LIMIT = 64 << 20
_LISTING = ("__iter__", "__len__", "__repr__")


class _Tracker:
    """Records the keys of ``os.environ`` read, and whether it was listed, while entered."""

    def __init__(self) -> None:
        # Annotations in a function body are not evaluated: any Python reads them.
        self.read: set[str] = set()
        self.listed = False
        self._type = type(os.environ)
        self._saved: dict[str, Any] = {
            name: self._type.__dict__[name] for name in ("__getitem__", *_LISTING)
        }

    def __enter__(self) -> "_Tracker":
        saved = self._saved

        def getitem(environ: "Any", key: "Any") -> "Any":
            self.read.add(os.fsdecode(key) if isinstance(key, bytes) else str(key))
            return saved["__getitem__"](environ, key)

        def listing(name: str) -> "Callable[[Any], Any]":
            def method(environ: "Any") -> "Any":
                self.listed = True
                return saved[name](environ)

            return method

        self._type.__getitem__ = getitem  # type: ignore[method-assign]
        for name in _LISTING:
            setattr(self._type, name, listing(name))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, method in self._saved.items():
            setattr(self._type, name, method)


class _Channel:
    """One JSON object per line each way, over the two pipes."""

    def __init__(
        self,
        read_fd: int,
        write_fd: int,
        loads: "Callable[[bytes], Any]",
        dumps: "Callable[[Any], str]",
    ) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._loads = loads
        self._dumps = dumps
        self._buffer = b""

    def receive(self) -> "dict[str, Any]":
        while b"\n" not in self._buffer:
            chunk = os.read(self._read_fd, 1 << 16)
            if not chunk:
                # The agent closed the pipe: this spare is not wanted.
                os._exit(0)
            self._buffer += chunk
            if len(self._buffer) > _MESSAGE_LIMIT:
                raise ValueError("a message over the limit")
        line, _, self._buffer = self._buffer.partition(b"\n")
        message = self._loads(line)
        if not isinstance(message, dict):
            raise TypeError("a message that is not an object")
        return message

    def send(self, message: "dict[str, Any]") -> None:
        data = (self._dumps(message) + "\n").encode()
        while data:
            data = data[os.write(self._write_fd, data) :]

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)


def _leave_path(directory: str) -> None:
    """Remove ``directory`` from ``sys.path`` and the importer cache."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p) != directory]
    sys.path_importer_cache.pop(directory, None)


def _forget_modules(before: "set[str]") -> None:
    """Take the modules imported since ``before`` out of ``sys.modules`` (and their parents)."""
    for name in [n for n in sys.modules if n not in before]:
        parent, _, child = name.rpartition(".")
        if parent in before and getattr(sys.modules[parent], child, None) is sys.modules[name]:
            delattr(sys.modules[parent], child)
        del sys.modules[name]


def _customize() -> None:
    """Run the real ``sitecustomize`` and ``usercustomize`` as ``site`` does."""
    import site  # noqa: PLC0415 - imported already, at start-up

    site.execsitecustomize()
    if site.ENABLE_USER_SITE:
        # site imports it again after this module returns: a no-op then.
        site.execusercustomize()


def _local(top: str, path0: "str | None") -> bool:
    """Tell whether module ``top`` would come from the script's own directory."""
    if path0 is None:
        return False
    finder = sys.modules["_frozen_importlib_external"].PathFinder
    return finder.find_spec(top, [path0]) is not None


def _run_step(step: "Any", path0: "str | None", main: "dict[str, Any] | None") -> bool:
    """Run one import statement of the plan; False when it must not run here."""
    code, filename, module, tops = step["code"], step["filename"], step["module"], step["tops"]
    if not (isinstance(code, str) and isinstance(filename, str) and isinstance(module, str)):
        raise TypeError("a malformed step")
    if not isinstance(tops, list) or any(_local(str(top), path0) for top in tops):
        return False
    try:
        compiled = compile(code, filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        # This interpreter reads the statement differently: Python reports
        # it after "go", as for a cold start.
        return False
    namespace = main if main is not None and module == "__main__" else {"__name__": module}
    exec(compiled, namespace)  # noqa: S102 - the script's own import statements
    return True


def _import(name: str) -> None:
    """Import a module the agent was told to preload; one this interpreter lacks is skipped."""
    try:
        __import__(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not missing or not (name == missing or name.startswith(missing + ".")):
            raise


def _preload(plan: "dict[str, Any]") -> None:
    """Run the plan's leading import statements (up to local code), then its extra imports."""
    steps, extra = plan.get("steps"), plan.get("extra")
    if not isinstance(steps, list) or not isinstance(extra, list):
        raise TypeError("a plan without steps")
    if not steps and not extra:
        return
    path0 = plan.get("path0")
    if getattr(sys.flags, "safe_path", False) or not isinstance(path0, str):
        path0 = None
    filename = plan.get("main_file")
    main = None
    if isinstance(filename, str):
        # What Python sets in __main__ before it runs a script.
        main = sys.modules["__main__"].__dict__
        saved_loader = main.get("__loader__")
        loader_type = sys.modules["_frozen_importlib_external"].SourceFileLoader
        main.update(
            __file__=filename, __cached__=None, __loader__=loader_type("__main__", filename)
        )
    if path0 is not None:
        sys.path.insert(0, path0)
    try:
        for step in steps:
            if not _run_step(step, path0, main):
                break
        for name in extra:
            _import(str(name))
    finally:
        if main is not None:
            del main["__file__"], main["__cached__"]
            main["__loader__"] = saved_loader
        if path0 is not None:
            if not sys.path or sys.path[0] != path0:
                raise RuntimeError("the preloaded modules changed sys.path[0]")
            del sys.path[0]


def _module_files(before: "set[str]") -> "list[list[Any]]":
    """The files of the modules imported since ``before``, with their mtime and size."""
    files = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name in before or not isinstance(path, str):
            continue
        try:
            stat = os.stat(path)
        except OSError:
            continue
        files.append([path, stat.st_mtime_ns, stat.st_size])
    return files


def _attempt_env(env: "dict[str, str]", start: "dict[str, str]") -> "dict[str, str]":
    """The attempt's environment with the preload's own changes (``start`` -> now) made to it.

    A cold worker would have made the same changes (its ``sitecustomize`` or
    imports setting a variable) to the attempt's environment.
    """
    now = dict(os.environ)
    result = {key: value for key, value in env.items() if key in now or key not in start}
    result.update((key, value) for key, value in now.items() if start.get(key) != value)
    return result


def _spare(fds: str) -> None:
    read_fd, write_fd = (int(fd) for fd in fds.split(","))
    before = set(sys.modules)
    import json  # noqa: PLC0415 - only spares need it, and it leaves sys.modules again

    channel = _Channel(read_fd, write_fd, json.loads, json.dumps)
    plan = channel.receive()
    _forget_modules(before)
    pythonpath = plan.get("pythonpath")
    if isinstance(pythonpath, str):
        os.environ["PYTHONPATH"] = pythonpath
    else:
        del os.environ["PYTHONPATH"]
    start_env, start_cwd = dict(os.environ), os.getcwd()
    before = set(sys.modules)
    with _Tracker() as tracker:
        _customize()
        _preload(plan)
    channel.send(
        {
            "ready": True,
            "read": sorted(tracker.read),
            "listed": tracker.listed,
            "files": _module_files(before),
        }
    )
    go = channel.receive()
    env, cwd = go.get("env"), go.get("cwd")
    if not isinstance(env, dict) or not isinstance(cwd, str):
        raise TypeError("a go message without env and cwd")
    env = _attempt_env(env, start_env)
    os.environ.clear()
    os.environ.update(env)
    if os.getcwd() == start_cwd:
        # (A preloaded module that changed directory did what it would have done cold.)
        os.chdir(cwd)
    channel.send({"went": True})
    channel.close()


def _run() -> None:
    fds = os.environ.pop(_FDS_VARIABLE, None)
    _leave_path(os.path.dirname(os.path.abspath(__file__)))
    del sys.modules["sitecustomize"]
    if fds is None:
        # Not a spare (a child of a worker that kept PYTHONPATH): step aside.
        _customize()
    else:
        try:
            _spare(fds)
        except BaseException:  # noqa: BLE001 - whatever it was, the script must not run
            os._exit(_FAILED)
    if "sitecustomize" not in sys.modules:
        # No other sitecustomize: leave as a missing one does.
        raise ImportError("no sitecustomize besides rdzv's warm spares", name="sitecustomize")


_run()
