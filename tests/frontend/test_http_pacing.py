"""The HTTP face's pacer: a stream holds after each chunk only while the frontend is busy."""

from __future__ import annotations

import time

import pytest

from frontend_svc.service.http import pacing
from frontend_svc.service.http.pacing import BusyShare, Pacer, paced
from frontend_svc.text.output_processor import ChoiceOutput
from tandem_common.types import FinishReason


class FixedShare:
    """A busy share that stays where the test puts it."""

    def __init__(self, share: float) -> None:
        self.share = share

    def read(self) -> float:
        return self.share


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.parametrize(
    "share, hold",
    [
        (0.0, 0.0),
        (pacing.SHARE_LOW, 0.0),
        ((1 + pacing.SHARE_LOW) / 2, pacing.MAX_HOLD_S / 2),
        (1.0, pacing.MAX_HOLD_S),
    ],
)
def test_the_hold_grows_from_nothing_to_the_most_with_the_busy_share(share, hold):
    assert Pacer(FixedShare(share)).hold() == pytest.approx(hold)


def test_the_busy_share_of_a_thread_that_computes_and_of_one_that_sleeps():
    busy = BusyShare()
    for _ in range(40):  # 200 ms of computing, read as the pacer reads it
        _burn(pacing.SAMPLE_S)
        busy.read()
    assert busy.share > 0.8
    for _ in range(40):  # then 200 ms asleep (waiting for a core would still count as busy)
        time.sleep(pacing.SAMPLE_S)
        busy.read()
    assert busy.share < 0.2


def _piece(i: int, *, finished: bool = False) -> ChoiceOutput:
    return ChoiceOutput(index=0, text=f"t{i}", token_ids=[i], finish_reason=FinishReason.LENGTH if finished else None)


async def _stream(n: int):
    for i in range(n):
        yield _piece(i, finished=i == n - 1)


async def _gaps(pacer: Pacer) -> list[float]:
    """Seconds between the writer's asks for the next piece (the time it held)."""
    gaps, last = [], None
    async for piece in paced(_stream(4), pacer):
        if last is not None:
            gaps.append(time.monotonic() - last)
        last = time.monotonic()
        assert piece.token_ids
    return gaps


async def test_an_idle_frontend_writes_each_piece_at_once_and_a_busy_one_holds():
    assert max(await _gaps(Pacer(FixedShare(0.0)))) < pacing.MAX_HOLD_S / 2
    gaps = await _gaps(Pacer(FixedShare(1.0)))
    assert len(gaps) == 3 and min(gaps) >= pacing.MAX_HOLD_S * 0.9
