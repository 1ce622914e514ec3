"""The autoscale policy (``lifecycle.link.autoscale``), in memory: readings in, the
replica count wanted out; and ``--ray-autoscale``'s checks."""

from __future__ import annotations

import pytest

from lifecycle.link.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    autoscale_after,
    autoscale_bounds,
)

RUNNING = 4  # requests one replica runs at once


def _walk(scaler: Autoscaler, count: int, readings: list[tuple[float, list[int]]]) -> list[int]:
    out = []
    for now, held in readings:
        count = scaler.target(now, count, held, RUNNING)
        out.append(count)
    return out


def test_a_queue_that_lasts_adds_one_replica_at_a_time_up_to_max() -> None:
    s = Autoscaler(AutoscaleConfig(1, 3, queue=1.0, up_after=2.0, down_after=10.0))
    # 10 held by one replica that runs 4: 6 queued, for 2 s: one more
    assert _walk(s, 1, [(0.0, [10]), (1.0, [10]), (2.0, [10])]) == [1, 1, 2]
    # the new one not ready yet: not counted as wanting another
    assert _walk(s, 2, [(3.0, [10]), (10.0, [10])]) == [2, 2]
    assert _walk(s, 2, [(11.0, [8, 8]), (13.0, [8, 8]), (14.0, [9, 9]), (20.0, [9, 9])]) == [
        2,
        3,
        3,
        3,
    ]


def test_a_short_burst_or_a_queue_at_the_threshold_adds_none() -> None:
    s = Autoscaler(AutoscaleConfig(1, 3, queue=1.0, up_after=2.0, down_after=10.0))
    assert _walk(s, 1, [(0.0, [9]), (1.5, [4]), (2.0, [9]), (3.9, [9])]) == [1, 1, 1, 1]
    assert _walk(s, 1, [(10.0, [5]), (20.0, [5])]) == [1, 1]  # 1 queued: not above 1


def test_a_low_load_that_lasts_removes_one_down_to_min() -> None:
    s = Autoscaler(AutoscaleConfig(2, 4, queue=1.0, up_after=1.0, down_after=5.0))
    # 3 replicas holding 8 in all: 4 + 4 fits on two, none queued
    assert _walk(s, 3, [(0.0, [3, 3, 2]), (4.0, [3, 3, 2]), (5.0, [3, 3, 2])]) == [3, 3, 2]
    assert _walk(s, 2, [(6.0, [0, 0]), (20.0, [0, 0])]) == [2, 2]  # MIN
    s = Autoscaler(AutoscaleConfig(1, 4, queue=1.0, up_after=1.0, down_after=5.0))
    assert _walk(s, 2, [(0.0, [3, 3]), (9.0, [3, 3])]) == [2, 2]  # 6 does not fit on one


def test_bounds_and_waits_are_checked() -> None:
    assert autoscale_bounds("1:4") == (1, 4) and autoscale_bounds(" 2 : 2 ") == (2, 2)
    for bad, why in (("0:2", "1 <= MIN <= MAX"), ("3:2", "1 <= MIN <= MAX"), ("2", "MIN:MAX")):
        with pytest.raises(ValueError, match=why):
            autoscale_bounds(bad)
    assert autoscale_after("0.5:2") == (0.5, 2.0)
    for bad in ("0:2", "1", "1.2.3:4"):
        with pytest.raises(ValueError, match="UP:DOWN seconds"):
            autoscale_after(bad)


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"ray_autoscale": "1:2"}, "give --ray with it"),
        ({"ray_autoscale_after": "1:2"}, "give --ray with it"),
        ({"ray": "local", "ray_autoscale": "2:1"}, "1 <= MIN <= MAX"),
        ({"ray": "local", "ray_autoscale": "1:2", "dp": 3}, "--dp 3 is outside"),
        ({"ray": "local", "ray_autoscale_queue": 2.0}, "tune --ray-autoscale"),
    ],
)
def test_serve_refuses_autoscale_options_that_do_not_fit(
    options: dict[str, object], why: str
) -> None:
    from lifecycle.runtime import AppConfig, _supervisor

    with pytest.raises(ValueError, match=why):
        _supervisor(AppConfig(**options))  # type: ignore[arg-type]
