"""The idle timeout counts progress (complete SSE events or comments), not bytes."""

from __future__ import annotations

import asyncio

import pytest

from worker.errors import UpstreamTimeoutError
from worker.protocol.sse import SSEDecoder
from worker.upstream.idle import ProgressDeadline

TIMEOUT = 0.4


async def feed(decoder: SSEDecoder, pieces: list[bytes], every: float) -> None:
    for piece in pieces:
        decoder.feed_data(piece)
        await asyncio.sleep(every)


async def test_keep_alive_comments_alone_keep_a_stream_alive_past_the_timeout() -> None:
    decoder = SSEDecoder()
    async with ProgressDeadline("default", TIMEOUT, decoder):
        await feed(decoder, [b": keep-alive\n\n"] * 30, every=TIMEOUT / 8)  # 1.5 timeouts
    assert decoder.progress == 30


async def test_events_keep_a_stream_alive_past_the_timeout() -> None:
    decoder = SSEDecoder()
    async with ProgressDeadline("default", TIMEOUT, decoder):
        await feed(decoder, [b'data: {"n":1}\n\n'] * 30, every=TIMEOUT / 8)


async def test_an_event_dripped_byte_by_byte_stalls_mid_event() -> None:
    decoder = SSEDecoder()
    decoder.feed_data(b"data: first\n\n")
    endless = [b"data: ", *[b"x"] * 100_000]
    with pytest.raises(UpstreamTimeoutError) as raised:
        async with ProgressDeadline("default", TIMEOUT, decoder):
            await feed(decoder, endless, every=TIMEOUT / 20)
    sent = decoder.unfinished
    assert sent > 6
    assert raised.value.message == (
        f"upstream 'default': stalled mid-event: sent {sent} bytes of an event but no "
        f"complete SSE event or comment for {TIMEOUT:g}s"
    )
    assert raised.value.upstream == "default"


async def test_silence_is_no_data() -> None:
    decoder = SSEDecoder()
    with pytest.raises(UpstreamTimeoutError, match=r"^upstream 'u': no data for 0\.4s$"):
        async with ProgressDeadline("u", TIMEOUT, decoder):
            await asyncio.sleep(60)


async def test_blank_lines_are_no_progress() -> None:
    decoder = SSEDecoder()
    with pytest.raises(UpstreamTimeoutError, match="no data for"):
        async with ProgressDeadline("u", TIMEOUT, decoder):
            await feed(decoder, [b"\n"] * 100_000, every=TIMEOUT / 20)


async def test_a_cancel_from_outside_stays_a_cancel() -> None:
    decoder = SSEDecoder()

    async def read() -> None:
        async with ProgressDeadline("u", TIMEOUT, decoder):
            await asyncio.sleep(60)

    task = asyncio.create_task(read())
    await asyncio.sleep(TIMEOUT / 4)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_other_errors_pass_through_and_no_timer_is_left() -> None:
    decoder = SSEDecoder()
    with pytest.raises(ValueError, match="boom"):
        async with ProgressDeadline("u", TIMEOUT, decoder):
            raise ValueError("boom")
    await asyncio.sleep(TIMEOUT * 1.5)  # a timer left armed would cancel this task now
