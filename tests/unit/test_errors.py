import pytest

import rdzv


@pytest.mark.parametrize(
    "name",
    [
        "RendezvousClosedError",
        "RendezvousTimeoutError",
        "RendezvousConnectionError",
        "RendezvousStateError",
        "RendezvousGracefulExitError",
        "RendezvousExhaustedError",
    ],
)
def test_every_error_is_a_rendezvous_error(name: str) -> None:
    assert issubclass(getattr(rdzv, name), rdzv.RendezvousError)


def test_exhausted_is_caught_by_timeout_clauses() -> None:
    with pytest.raises(rdzv.RendezvousTimeoutError) as info:
        raise rdzv.RendezvousExhaustedError("run_id=job min_nodes=4", 2.5)
    err = info.value
    assert isinstance(err, rdzv.RendezvousExhaustedError)
    assert err.timeout == 2.5
    assert err.config == "run_id=job min_nodes=4"
    assert "2.5 s" in str(err)
    assert "min nodes" in str(err)
    assert "run_id=job" in str(err)


def test_store_timeout_is_a_rendezvous_timeout() -> None:
    assert issubclass(rdzv.StoreTimeoutError, rdzv.RendezvousTimeoutError)
