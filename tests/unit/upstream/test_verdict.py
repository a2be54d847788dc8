"""worker.upstream.verdict: what a failed try says, from what a hostile upstream may send."""

from __future__ import annotations

from worker.errors import MidStreamError
from worker.protocol.accumulator import error_status
from worker.upstream.verdict import Grain, judge, judge_stream_error


def test_an_error_chunks_status_is_read_from_its_code_or_status() -> None:
    assert error_status({"code": "503"}) == 503
    assert error_status({"code": "overloaded", "status": 529}) == 529
    assert error_status({"code": 42, "status": "abc"}) is None


def test_a_code_of_thousands_of_digits_is_no_status_and_no_crash() -> None:
    """``int()`` refuses strings of more than 4,300 digits: such a code must not reach it."""
    error = {"code": "9" * 5000, "type": "server_error", "message": "x"}
    assert error_status(error) is None
    assert judge_stream_error(error).move  # its type still says "try again"
    exc = MidStreamError("x", status=error_status(error), detail=error)
    assert judge(exc).grain is Grain.TARGET
