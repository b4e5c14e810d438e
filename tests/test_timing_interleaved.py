"""timing.time_interleaved on the CPU, with a clock the test moves: the order of the calls (warm-up case by case,
then round after round of every case, untimed then timed), the budget, failing cases, the stats per case."""
import pytest
import torch

from dit_accel.timing import time_interleaved

CPU = torch.device("cpu")


class FakeClock:
    """A clock that moves only when a case runs: each call of a case adds that case's next duration."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def case(self, name: str, seconds):
        """A case whose k-th call takes seconds[k] (a list) or always `seconds`."""
        def call():
            k = self.calls.count(name)
            self.calls.append(name)
            self.now += seconds[k] if isinstance(seconds, list) else seconds
        return call


def test_cases_are_warmed_up_in_turn_then_timed_in_interleaved_rounds():
    clock = FakeClock()
    # a: two warm-up calls (a slow first one, as a compile), then per round an untimed and a timed call
    a = clock.case("a", [9.0, 1.0] + [0.5, 0.001, 0.5, 0.003, 0.5, 0.002])
    b = clock.case("b", [7.0, 1.0] + [0.5, 0.010, 0.5, 0.030, 0.5, 0.020])
    stats = time_interleaved({"a": a, "b": b}, device=CPU, warmup=2, rounds=3, clock=clock)
    assert clock.calls == ["a", "a", "b", "b"] + ["a", "a", "b", "b"] * 3
    assert list(stats) == ["a", "b"]
    assert stats["a"].samples_ms == pytest.approx((1.0, 3.0, 2.0))  # the timed calls alone, in order
    assert stats["b"].samples_ms == pytest.approx((10.0, 30.0, 20.0))
    assert (stats["a"].median_ms, stats["a"].min_ms, stats["a"].max_ms, stats["a"].runs) == pytest.approx(
        (2.0, 1.0, 3.0, 3))
    assert stats["b"].median_ms == pytest.approx(20.0)


def test_the_budget_stops_warm_ups_and_rounds_and_each_case_keeps_its_samples():
    """Each call costs 1 s of a 10 s budget. The warm-up of both cases fits (4 s); the rounds stop inside the
    second (a sample costs 2 s: a's at 4-6 and 8-10 s, b's at 6-8 s, then b finds the budget spent)."""
    clock = FakeClock()
    cases = {"a": clock.case("a", 1.0), "b": clock.case("b", 1.0)}
    stats = time_interleaved(cases, device=CPU, warmup=2, rounds=7, budget_s=9.5, clock=clock)
    assert (stats["a"].runs, stats["b"].runs) == (2, 1)
    assert clock.calls == ["a", "a", "b", "b"] + ["a", "a", "b", "b", "a", "a"]
    # Room for one warm-up (a's) only: no samples, so no stats; b never runs.
    clock = FakeClock()
    cases = {"a": clock.case("a", 1.0), "b": clock.case("b", 1.0)}
    assert time_interleaved(cases, device=CPU, warmup=2, rounds=7, budget_s=1.5, clock=clock) == {}
    assert clock.calls == ["a", "a"]


def test_a_failing_case_is_reported_and_dropped_while_the_others_go_on():
    clock = FakeClock()
    failures = []
    calls_of_late = []

    def broken():
        raise RuntimeError("no kernel for this shape")

    def fails_in_round_two():
        calls_of_late.append(1)
        clock.now += 0.001
        if len(calls_of_late) == 4:  # warm-up 1, round 1: 2 and 3, round 2: 4
            raise ValueError("out of memory")

    cases = {"a": clock.case("a", 0.001), "broken": broken, "late": fails_in_round_two}
    stats = time_interleaved(cases, device=CPU, warmup=1, rounds=3, clock=clock,
                             on_error=lambda name, error: failures.append((name, str(error))))
    assert failures == [("broken", "no kernel for this shape"), ("late", "out of memory")]
    assert list(stats) == ["a"] and stats["a"].runs == 3  # late's round-one sample is not kept
    assert len(calls_of_late) == 4
    with pytest.raises(RuntimeError, match="no kernel"):  # without on_error the exception propagates
        time_interleaved({"broken": broken}, device=CPU, clock=clock)
