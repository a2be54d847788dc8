"""bench/bench_worker.py's capacity search: the light step first, then both ends bisected
to within 10%; a ratio resting on a step taken on a busy machine is not judged.

The steps are fakes (a system that passes up to a threshold): no process is started."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_worker as bench


class FakeSystem:
    label = "fake"

    def __init__(self, name: str) -> None:
        self.name = name


def fake_steps(
    monkeypatch: pytest.MonkeyPatch, limit: int, busy: set[int] | None = None
) -> list[int]:
    """capacity_step replaced: N passes when N <= limit; steps in ``busy`` were busy."""
    ran: list[int] = []

    async def step(env: Any, system: Any, n: int) -> bench.Step:
        ran.append(n)
        result = bench.Step(n, p99=0.01, p99_written=0.004, worker_cpu_s=n * 1e-3, tokens=n)
        if n > limit:
            result.problems.append("p99 80 ms")
        if busy and n in busy:
            result.background = 0.9
        return result

    monkeypatch.setattr(bench, "capacity_step", step)
    monkeypatch.setattr(bench, "STEP_HEADER", "")
    return ran


class FakeEnv:
    def __init__(self, plan: bench.Plan) -> None:
        self.plan = plan


@pytest.mark.parametrize(("limit", "start"), [(317, 200), (43, 25), (120, 200)])
async def test_the_search_brackets_the_capacity_within_ten_percent(
    monkeypatch: pytest.MonkeyPatch, limit: int, start: int
) -> None:
    ran = fake_steps(monkeypatch, limit)
    plan = bench.Plan(start_ours=start, start_peer=start)
    found = await bench.capacity(FakeEnv(plan), FakeSystem("ours"))  # type: ignore[arg-type]
    assert ran[0] == plan.light and found.light is not None and found.light.streams == 60
    assert found.best is not None and found.fail is not None
    assert found.best.streams <= limit < found.fail.streams
    gap = found.fail.streams - found.best.streams
    assert gap <= max(bench.grain(found.best.streams), 0.1 * found.best.streams)
    assert len(ran) <= 1 + 12  # light, doubling/halving, at most six bisections


async def test_exact_steps_run_as_given_without_the_light_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran = fake_steps(monkeypatch, 250)
    plan = bench.Plan(steps=(200, 300))
    found = await bench.capacity(FakeEnv(plan), FakeSystem("ours"))  # type: ignore[arg-type]
    assert ran == [200, 300]
    assert found.best is not None and found.best.streams == 200


async def test_a_ratio_resting_on_a_busy_step_is_not_judged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = bench.Plan()
    fake_steps(monkeypatch, 300)
    ours = await bench.capacity(FakeEnv(plan), FakeSystem("ours"))  # type: ignore[arg-type]
    peer_ran = fake_steps(monkeypatch, 30, busy={35})
    peer = await bench.capacity(FakeEnv(plan), FakeSystem("peer"))  # type: ignore[arg-type]
    assert 35 in peer_ran and peer.busy and not ours.busy
    row = bench._capacity_rows(ours, peer, plan, "plain HTTP", 8)[0]
    assert row[3].startswith("(") and "not judged" in row[5]
    quiet = bench._capacity_rows(ours, None, plan, "plain HTTP", 8)[0]
    assert "not judged" not in quiet[5]
