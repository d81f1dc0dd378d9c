"""Coverage-guided fuzz targets (atheris, i.e. libFuzzer) for the store's
frame parser and the rendezvous state codecs.

Run one by hand, e.g. for ten minutes::

    python -m tests.fuzz.atheris_targets parser -max_total_time=600 -artifact_prefix=/tmp/
    python -m tests.fuzz.atheris_targets state -runs=1000000

Any libFuzzer flag may follow the target name. A crash (an exception other
than the documented one) stops the run with a non-zero status and writes the
input to ``<artifact_prefix>crash-<sha1>``; add it to the regression tests.
"""

from __future__ import annotations

import contextlib
import sys

import atheris

with atheris.instrument_imports():
    from rdzv.dynamic.state import decode_record, decode_state, encode_state
    from rdzv.errors import RendezvousStateError
    from rdzv.store.protocol import ProtocolError, RequestParser, encode_request

from tests.fuzz.test_fuzz_frames import parse_all  # after the instrumented imports


def fuzz_parser(data: bytes) -> None:
    """Feed the input to a parser in fuzzer-chosen chunks; only ProtocolError may escape."""
    provider = atheris.FuzzedDataProvider(data)
    chunks = []
    while provider.remaining_bytes():
        chunks.append(provider.ConsumeBytes(provider.ConsumeIntInRange(1, 64)))
    try:
        decoded = parse_all(chunks)
    except ProtocolError:
        return
    # Whatever decoded must re-encode and decode to the same requests.
    again = RequestParser()
    again.feed(b"".join(encode_request(r) for r in decoded))
    for request in decoded:
        assert again.next_request() == request


def fuzz_state(data: bytes) -> None:
    """Decode the input as a state and as a join record; only RendezvousStateError may escape."""
    try:
        state = decode_state(data)
    except RendezvousStateError:
        pass
    else:
        assert decode_state(encode_state(state)) == state
    with contextlib.suppress(RendezvousStateError):
        decode_record(data)


TARGETS = {"parser": fuzz_parser, "state": fuzz_state}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        names = ",".join(TARGETS)
        sys.exit(f"usage: python -m tests.fuzz.atheris_targets {{{names}}} [libFuzzer flags]")
    target = TARGETS[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
