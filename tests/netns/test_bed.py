"""The network-namespace test bed: addresses, reachability, partitions, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rdzv.testing.netns import NetnsBed, bed_names, sweep_stale
from tests.netns.conftest import ProbedBed, all_pairs, open_bed
from tests.procs import subprocess_env


def gone_or_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited (reaped, or a zombie its new parent has yet to reap)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(60)
@pytest.mark.xdist_group("netns-probed4")  # one bed for the three (module fixture)
def test_hosts_have_own_addresses_and_reach_each_other(probed4: ProbedBed) -> None:
    probed4.bed.heal()
    for host in probed4.bed.hosts:
        shown = host.run(["ip", "-o", "addr", "show"], check=True).stdout
        assert f"inet {host.ipv4}/24" in shown
        assert f"inet6 {host.ipv6}/64" in shown
        assert "inet 127.0.0.1/8" in shown
        others = [h for h in probed4.bed.hosts if h is not host]
        assert all(f" {h.ipv4}/" not in shown for h in others)
    assert len({h.ipv4 for h in probed4.bed.hosts}) == 4
    assert probed4.connected_pairs() == all_pairs(4)
    assert probed4.connected_pairs(ipv6=True) == all_pairs(4)
    assert probed4.reachable(probed4.bed.hosts[0], ["127.0.0.1", "::1"]) == {
        "127.0.0.1": True,
        "::1": True,
    }


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.xdist_group("netns-probed4")  # one bed for the three (module fixture)
def test_isolate_cuts_exactly_one_host_and_heal_restores(probed4: ProbedBed) -> None:
    bed = probed4.bed
    bed.isolate(2)
    assert bed.cut_pairs() == {(0, 2), (1, 2), (2, 3)}
    expected = {(a, b) for a, b in all_pairs(4) if 2 not in (a, b)}
    assert probed4.connected_pairs() == expected
    assert probed4.connected_pairs(ipv6=True) == expected
    # The isolated host still reaches itself.
    assert probed4.reachable(bed.hosts[2], [bed.hosts[2].ipv4, "127.0.0.1"]) == {
        bed.hosts[2].ipv4: True,
        "127.0.0.1": True,
    }
    bed.heal()
    assert bed.cut_pairs() == set()
    assert probed4.connected_pairs() == all_pairs(4)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.xdist_group("netns-probed4")  # one bed for the three (module fixture)
def test_splits_cut_exactly_the_pairs_across_groups(probed4: ProbedBed) -> None:
    bed = probed4.bed
    bed.partition([[0, 1], [2, 3]])
    assert probed4.connected_pairs() == {(0, 1), (1, 0), (2, 3), (3, 2)}
    # A new partition replaces the old one; unnamed hosts form one group.
    bed.partition([[0], [1]])
    assert probed4.connected_pairs() == {(2, 3), (3, 2)}
    bed.partition([[0, 2], [1, 3]])
    assert probed4.connected_pairs() == {(0, 2), (2, 0), (1, 3), (3, 1)}
    # Pairwise cuts need not be transitive: 0 still reaches 1 and 2.
    bed.cut([(1, 2), (3, 0)])
    assert bed.cut_pairs() == {(1, 2), (0, 3)}
    assert probed4.connected_pairs() == all_pairs(4) - {(1, 2), (2, 1), (0, 3), (3, 0)}
    bed.heal()
    assert probed4.connected_pairs() == all_pairs(4)


@pytest.mark.timeout(60)
def test_nothing_is_left_after_exit_even_on_an_error() -> None:
    open_bed(1).close()  # skips with the reason where namespaces cannot be made
    bed = NetnsBed(2)
    sleepers: list[subprocess.Popen[str]] = []

    def fail_inside() -> None:
        with bed:
            sleepers.append(
                bed.hosts[1].popen(
                    ["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
            assert bed_names(bed.tag)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    tag, sleeper = bed.tag, sleepers[0]
    assert bed_names(tag) == []
    assert sleeper.wait(timeout=10) == -signal.SIGKILL


CREATOR = textwrap.dedent(
    """
    import subprocess, time
    from rdzv.testing.netns import NetnsBed
    bed = NetnsBed(2).__enter__()
    bed.hosts[0].popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bed.partition([[0], [1]])
    print(bed.tag, flush=True)
    time.sleep(300)
    """
)


@pytest.mark.timeout(60)
def test_a_sigkilled_creator_is_swept_by_the_next_run() -> None:
    open_bed(1).close()  # skips with the reason where namespaces cannot be made
    creator = subprocess.Popen(
        [sys.executable, "-c", CREATOR], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    assert creator.stdout is not None
    tag = creator.stdout.readline().strip()
    assert tag.startswith(f"rdzv{creator.pid}")
    os.kill(creator.pid, signal.SIGKILL)
    # Unreaped, the dead creator still counts as alive to every sweep, so a
    # bed that another test worker opens meanwhile leaves its leftovers be.
    assert gone_or_zombie(creator.pid)
    left = bed_names(tag)
    assert sorted(left) == sorted([f"{tag}h0", f"{tag}h1", f"{tag}b", f"{tag}v0", f"{tag}v1"])
    orphans = subprocess.run(
        ["ip", "netns", "pids", f"{tag}h0"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(orphans) == 1
    creator.wait(timeout=10)  # now stale: the next bed to open sweeps it
    creator.stdout.close()
    with NetnsBed(1) as bed:  # entering sweeps stale beds
        assert not bed.tag.startswith(tag)
        assert bed_names(tag) == []
    assert gone_or_zombie(int(orphans[0]))
    assert sweep_stale() == []
