"""The side-by-side check: the same call on torch and on rdzv, the same outcome."""

from __future__ import annotations

from collections.abc import Callable


def raised(call: Callable[[], object]) -> BaseException:
    """Run ``call`` and return what it raised; fail when it returned."""
    try:
        result = call()
    except Exception as exc:
        return exc
    raise AssertionError(f"expected an error, got {result!r}")


def same_error(
    torch_call: Callable[[], object],
    rdzv_call: Callable[[], object],
    torch_type: type[BaseException],
    rdzv_type: type[BaseException] | None = None,
) -> tuple[BaseException, BaseException]:
    """Assert both calls fail, with the types given, rdzv's message starting with torch's.

    Returns:
        ``(torch's error, rdzv's error)``.
    """
    torch_error = raised(torch_call)
    rdzv_error = raised(rdzv_call)
    assert isinstance(torch_error, torch_type), repr(torch_error)
    assert isinstance(rdzv_error, rdzv_type or torch_type), repr(rdzv_error)
    assert str(torch_error), "torch's message is empty: nothing to compare"
    assert str(rdzv_error).startswith(str(torch_error)), (str(torch_error), str(rdzv_error))
    return torch_error, rdzv_error
