"""Run the chaos harness by hand: ``python -m tests.chaos.run --minutes 30``.

Prints the seed first and the figures at the end; exits 1 on any violation.
A failing seed replays with ``--seed``.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys

from tests.chaos.harness import ChaosRun, Settings

BACKENDS = ("tcp", "etcd", "etcd3", "redis")
"""Backends the harness drives: the TCP store, etcd (one and three members), Redis."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=1.0, help="per backend")
    parser.add_argument("--rounds", type=int, default=0, help="stop after this many rounds")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--agents", type=int, default=5)
    parser.add_argument("--backend", choices=[*BACKENDS, "all"], default="all")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--log-dir", default=None, help="one rdzv debug log per agent here")
    parser.add_argument(
        "--net",
        choices=["loopback", "netns"],
        default="loopback",
        help="netns: each agent and server in its own network namespace, partition faults (root)",
    )
    args = parser.parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C (which a shell's background job ignores),
    # so the agents, servers and namespaces of the run go with it.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    print(
        f"chaos seed={seed} backends={backends} net={args.net} minutes={args.minutes} each",
        flush=True,
    )
    violations = 0
    for backend in backends:
        settings = Settings(
            seed=seed,
            backend=backend,
            agents=args.agents,
            min_nodes=2,
            max_nodes=args.agents,
            seconds=args.minutes * 60,
            rounds=args.rounds,
            log_dir=args.log_dir,
            net=args.net,
        )
        figures = ChaosRun(settings, log=None if args.quiet else sys.stdout).run()
        print(figures.summary(), flush=True)
        violations += len(figures.violations)
    return 1 if violations else 0


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
