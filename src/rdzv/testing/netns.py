"""Many hosts on one Linux machine: network namespaces on a bridge, and partitions.

A :class:`NetnsBed` makes K "hosts", each a network namespace with loopback
up and one interface (``eth0``) on a shared Linux bridge, with its own IPv4
address (``10.213.0.<i+1>/24``) and IPv6 ULA address
(``fd72:647a:7600::<i+1>/64``). Commands run inside a host with
``ip netns exec``; a host sees only its own addresses, so code that infers
"is this my address" or "which address do peers reach me at" behaves as on a
real machine. Needs root and the ``ip`` command; standard library only::

    with NetnsBed(3) as bed:
        bed.hosts[0].run(["python3", "-c", "print('hello')"])
        bed.partition([[0], [1, 2]])  # 0 can reach neither 1 nor 2
        bed.cut([(1, 2)])  # only 1 and 2 cannot reach each other
        bed.heal()
        bed.hosts[1].call(urllib.request.urlopen, "http://10.213.0.1:8000/")

:meth:`Host.call` runs a Python function in a thread that has entered the
host's namespace (``setns(2)`` through ``ctypes``), so the test process
itself can reach servers on the hosts' addresses without a subprocess.

**Partitions** (:meth:`NetnsBed.partition`, :meth:`NetnsBed.isolate`,
:meth:`NetnsBed.cut`) drop packets silently, as a failed switch or a firewall
would: for every pair cut, each of the two hosts gets a policy
rule ``from <peer address> iif eth0 blackhole`` (IPv4 and IPv6), so packets
from the peer are discarded on arrival. New connections time out and
established ones stall (TCP retransmits) until :meth:`NetnsBed.heal`
removes the rules; they then resume. ARP and neighbour discovery still work.
Each namespace has its ``local`` routing table moved from rule priority 0 to
100 so that these rules (priority 10) are consulted before local delivery.
Neither ``tc netem`` nor nftables/iptables is needed.

**Cleanup.** Every name starts with ``rdzv<pid><letter>`` (the creating
process's pid): namespaces ``rdzv<pid><letter>h<i>``, the bridge
``rdzv<pid><letter>b``, host-side veths ``rdzv<pid><letter>v<i>``. Leaving
the ``with`` block (normally or by an exception) kills every process still
running in the namespaces and deletes them and the bridge. If the creator
is killed outright (SIGKILL), the next :class:`NetnsBed` to start (or
:func:`sweep_stale`) removes whatever belongs to a pid that no longer runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, Any, TypeVar

__all__ = ["Host", "NetnsBed", "NetnsUnavailable", "bed_names", "sweep_stale"]

PREFIX = "rdzv"
IPV4_NET = "10.213.0"
IPV6_NET = "fd72:647a:7600:"
MAX_HOSTS = 99
_RULE_PREF = "10"
_LOCAL_PREF = "100"
_NAME = re.compile(rf"^{PREFIX}(\d+)[a-z]")
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/run/netns"
_T = TypeVar("_T")
_letters = itertools.cycle("abcdefghijklmnopqrstuvwxyz")
_letters_lock = threading.Lock()


class NetnsUnavailable(RuntimeError):  # noqa: N818 (reads as the skip reason it carries)
    """Network namespaces cannot be made here (not root, no ``ip``, or refused)."""


def _ip(*args: str, check: bool = True, stdin: str | None = None) -> str:
    ip = shutil.which("ip")
    if ip is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not on PATH")
    proc = subprocess.run(
        [ip, *args], input=stdin, capture_output=True, text=True, check=False, timeout=30
    )
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(
            proc.returncode, ["ip", *args], proc.stdout, proc.stderr
        )
    return proc.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list", check=False).splitlines() if line]


def _links() -> list[str]:
    names = []
    for line in _ip("-o", "link", "show", check=False).splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _kill_processes_in(namespace: str) -> None:
    for token in _ip("netns", "pids", namespace, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(token), signal.SIGKILL)


def _remove(namespaces: Sequence[str], links: Sequence[str]) -> None:
    # Deleting a veth removes its peer at once; a namespace's own links would
    # otherwise linger until the kernel's asynchronous namespace cleanup.
    for namespace in namespaces:
        _kill_processes_in(namespace)
    for link in links:
        _ip("link", "delete", link, check=False)
    for namespace in namespaces:
        _ip("netns", "delete", namespace, check=False)


def bed_names(prefix: str = PREFIX) -> list[str]:
    """Return the namespaces and links whose names start with ``prefix``.

    Args:
        prefix: ``rdzv`` (every bed's), or one bed's :attr:`NetnsBed.tag`.

    Returns:
        The names, namespaces first, then links.
    """
    return [n for n in _namespaces() if n.startswith(prefix)] + [
        n for n in _links() if n.startswith(prefix)
    ]


def sweep_stale() -> list[str]:
    """Remove the namespaces and links of test beds whose creating process is gone.

    Processes still running in those namespaces are killed first.

    Returns:
        The names removed (namespaces first, then links).
    """

    def stale(names: list[str]) -> list[str]:
        found = []
        for name in names:
            match = _NAME.match(name)
            if match and not _pid_alive(int(match.group(1))):
                found.append(name)
        return found

    namespaces = stale(_namespaces())
    links = stale(_links())
    _remove(namespaces, links)
    return namespaces + links


def _enter_namespace(namespace: str) -> None:
    """Move the calling thread (only it) into ``namespace`` with ``setns(2)``."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fd = os.open(os.path.join(_NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Host:
    """One host of a :class:`NetnsBed`: a network namespace and its addresses.

    Attributes:
        index: The host's position in :attr:`NetnsBed.hosts`.
        namespace: The network namespace's name (for ``ip netns exec``).
        ipv4: The host's IPv4 address, without prefix length.
        ipv6: The host's IPv6 (ULA) address, without prefix length.
    """

    index: int
    namespace: str
    ipv4: str
    ipv6: str

    def command(self, args: Sequence[str]) -> list[str]:
        """Return ``args`` prefixed so that it runs inside this host."""
        return ["ip", "netns", "exec", self.namespace, *args]

    def run(
        self,
        args: Sequence[str],
        *,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside this host and wait for it (output captured as text).

        Args:
            args: The command and its arguments.
            timeout: Seconds after which the command is killed and
                ``subprocess.TimeoutExpired`` raised.
            env: The environment (the caller's when None).
            check: Raise ``subprocess.CalledProcessError`` on a non-zero exit.

        Returns:
            The finished process, with ``stdout`` and ``stderr``.
        """
        return subprocess.run(
            self.command(args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=None if env is None else dict(env),
            check=check,
        )

    def call(self, function: Callable[..., _T], *args: Any, timeout: float = 60.0) -> _T:
        """Call ``function(*args)`` in a new thread that runs inside this host.

        Sockets the function opens belong to the host's network namespace
        (and stay there when used later from other threads); the calling
        thread is not moved.

        Args:
            function: What to call.
            *args: Its arguments.
            timeout: Seconds to wait for the call to return.

        Returns:
            What ``function`` returned.

        Raises:
            TimeoutError: The call did not return within ``timeout`` (the
                thread, a daemon, is left to finish on its own).
            BaseException: Whatever ``function`` raised, re-raised here.
        """
        outcome: list[tuple[bool, Any]] = []

        def inside() -> None:
            try:
                _enter_namespace(self.namespace)
                outcome.append((True, function(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                outcome.append((False, exc))

        thread = threading.Thread(target=inside, name=f"netns-{self.namespace}", daemon=True)
        thread.start()
        thread.join(timeout)
        if not outcome:
            raise TimeoutError(
                f"{function!r} did not return within {timeout} s in {self.namespace}"
            )
        ok, value = outcome[0]
        if not ok:
            raise value
        result: _T = value
        return result

    def popen(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: int | IO[Any] | None = subprocess.PIPE,
        stderr: int | IO[Any] | None = subprocess.PIPE,
    ) -> subprocess.Popen[str]:
        """Start a command inside this host without waiting for it.

        ``ip netns exec`` replaces itself with the command, so the returned
        process's pid is the command's own: signal it directly.

        Args:
            args: The command and its arguments.
            env: The environment (the caller's when None).
            stdout: Where its output goes (a pipe by default).
            stderr: Where its error output goes (a pipe by default).

        Returns:
            The running process (text mode).
        """
        return subprocess.Popen(
            self.command(args),
            stdout=stdout,
            stderr=stderr,
            text=True,
            env=None if env is None else dict(env),
        )


@dataclass
class NetnsBed:
    """K hosts in network namespaces on one bridge, with partitions; a context manager.

    Entering creates everything (after sweeping stale beds); leaving removes
    everything, killing processes still running in the hosts.

    Args:
        count: The number of hosts (1 to 99).

    Raises:
        NetnsUnavailable: On entry, when not root, without the ``ip``
            command, or when the kernel refuses to make a namespace.
    """

    count: int
    hosts: list[Host] = field(default_factory=list, init=False)
    tag: str = field(default="", init=False)
    _cut: set[tuple[int, int]] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_HOSTS:
            raise ValueError(f"count must be between 1 and {MAX_HOSTS}, got {self.count}")

    @property
    def bridge(self) -> str:
        """The bridge's name."""
        return f"{self.tag}b"

    def veth(self, index: int) -> str:
        """Return the name of the bridge-side veth of host ``index``."""
        return f"{self.tag}v{index}"

    def __enter__(self) -> NetnsBed:
        if self.tag:
            raise RuntimeError("this NetnsBed was already entered; make a new one")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (this process is not root)")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("the `ip` command (iproute2) is not on PATH")
        sweep_stale()
        with _letters_lock:
            self.tag = f"{PREFIX}{os.getpid()}{next(_letters)}"
        try:
            self._create()
        except BaseException as exc:
            self.close()
            if isinstance(exc, subprocess.CalledProcessError) and not self.hosts:
                raise NetnsUnavailable(
                    f"cannot make network namespaces: {' '.join(exc.cmd)}: "
                    f"{(exc.stderr or '').strip()}"
                ) from exc
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _create(self) -> None:
        first = f"{self.tag}h0"
        _ip("netns", "add", first)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for index in range(self.count):
            host = Host(
                index, f"{self.tag}h{index}", f"{IPV4_NET}.{index + 1}", f"{IPV6_NET}:{index + 1}"
            )
            if index:
                _ip("netns", "add", host.namespace)
            self.hosts.append(host)
            veth = self.veth(index)
            _ip(
                "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace
            )
            _ip("link", "set", veth, "master", self.bridge, "up")
            ns = ("-n", host.namespace)
            _ip(*ns, "link", "set", "lo", "up")
            _ip(*ns, "addr", "add", f"{host.ipv4}/24", "dev", "eth0")
            _ip(*ns, "addr", "add", f"{host.ipv6}/64", "dev", "eth0", "nodad")
            _ip(*ns, "link", "set", "eth0", "up")
            for family in ("-4", "-6"):
                _ip(*ns, family, "rule", "add", "pref", _LOCAL_PREF, "lookup", "local")
                _ip(*ns, family, "rule", "del", "pref", "0")

    def close(self) -> None:
        """Remove the hosts and the bridge, killing processes still in the hosts.

        Safe to call more than once.
        """
        namespaces = [f"{self.tag}h{i}" for i in range(self.count)] if self.tag else []
        links = [self.bridge, *(self.veth(i) for i in range(self.count))] if self.tag else []
        present_ns = set(_namespaces())
        present_links = set(_links())
        _remove(
            [n for n in namespaces if n in present_ns], [n for n in links if n in present_links]
        )
        self.hosts = []
        self._cut.clear()

    def _rules(self, receiver: int, changes: Sequence[tuple[str, int]]) -> None:
        """Add or delete the blackhole rules of ``receiver``: one ``ip -batch`` per family."""
        host = self.hosts[receiver]
        for family in ("-4", "-6"):
            lines = "".join(
                f"rule {action} pref {_RULE_PREF} from "
                f"{self.hosts[sender].ipv4 if family == '-4' else self.hosts[sender].ipv6} "
                "iif eth0 blackhole\n"
                for action, sender in changes
            )
            _ip("-n", host.namespace, family, "-batch", "-", stdin=lines)

    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        """Split the hosts into groups that cannot reach each other.

        Hosts named in no group form one more group together. Replaces any
        partition in force: hosts in the same group can reach each other.

        Args:
            groups: Disjoint lists of host indices.

        Raises:
            ValueError: An index is out of range or in two groups.
        """
        group_of: dict[int, int] = {}
        for number, group in enumerate(groups):
            for index in group:
                if not 0 <= index < len(self.hosts):
                    raise ValueError(f"no host {index} (the bed has {len(self.hosts)})")
                if index in group_of:
                    raise ValueError(f"host {index} is in two groups")
                group_of[index] = number
        rest = len(groups)
        self._apply(
            {
                (a, b)
                for a in range(len(self.hosts))
                for b in range(len(self.hosts))
                if group_of.get(a, rest) != group_of.get(b, rest)
            }
        )

    def cut(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Cut exactly the given host pairs (both ways); every other pair connects.

        Unlike :meth:`partition` this can make reachability non-transitive:
        ``cut([(1, 2)])`` leaves host 0 reaching both 1 and 2. Replaces any
        partition in force.

        Args:
            pairs: Pairs of host indices.

        Raises:
            ValueError: An index is out of range, or a pair names one host twice.
        """
        wanted: set[tuple[int, int]] = set()
        for a, b in pairs:
            for index in (a, b):
                if not 0 <= index < len(self.hosts):
                    raise ValueError(f"no host {index} (the bed has {len(self.hosts)})")
            if a == b:
                raise ValueError(f"cannot cut host {a} from itself")
            wanted |= {(a, b), (b, a)}
        self._apply(wanted)

    def _apply(self, wanted: set[tuple[int, int]]) -> None:
        changes: dict[int, list[tuple[str, int]]] = {}
        for receiver, sender in sorted(self._cut - wanted):
            changes.setdefault(receiver, []).append(("del", sender))
        for receiver, sender in sorted(wanted - self._cut):
            changes.setdefault(receiver, []).append(("add", sender))
        for receiver, actions in sorted(changes.items()):
            self._rules(receiver, actions)
            for action, sender in actions:
                if action == "add":
                    self._cut.add((receiver, sender))
                else:
                    self._cut.discard((receiver, sender))

    def isolate(self, index: int) -> None:
        """Cut host ``index`` off from every other host (replaces any partition)."""
        self.partition([[index]])

    def heal(self) -> None:
        """End any partition: every host can reach every other again."""
        self.partition([])

    def cut_pairs(self) -> set[tuple[int, int]]:
        """Return the host pairs ``(a, b)``, ``a < b``, currently unable to reach each other."""
        return {(min(a, b), max(a, b)) for a, b in self._cut}
