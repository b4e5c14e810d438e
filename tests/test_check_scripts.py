"""The device check scripts' timing helper (scripts/check_fp8_attention.time_cases), with CUDA events
replaced by a clock the test controls."""
import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "check_fp8_attention.py")


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("check_fp8_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_time_cases_interleaves_rounds_and_warms_each_case_before_its_sample(script, monkeypatch):
    calls = []  # every call of a case's fn, timed or not, in order
    timed = []  # the case of each timed call
    ms_of = {"a": [5.0, 1.0, 1.0, 1.2, 1.1], "b": [9.0, 2.0, 2.0, 2.0, 2.4]}  # a slow first round for both

    def event_ms(fn):
        name = fn()
        timed.append(name)
        return ms_of[name][sum(t == name for t in timed) - 1]

    def case(name):
        return lambda: calls.append(name) or name

    def broken():
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(script, "event_ms", event_ms)
    report = {"timing": []}
    script.time_cases([("a", case("a")), ("broken", broken), ("b", case("b"))], report, "S1", 4.4e12,
                      lambda: False, iters=5, warmup=2, no_flop_rate="b")
    # warm-up: each case twice; then per round each case once untimed and once timed, a before b
    assert calls == ["a", "a", "b", "b"] + ["a", "a", "b", "b"] * 5
    assert timed == ["a", "b"] * 5
    a, bad, b = report["timing"]
    assert a == {"what": "a", "shape": "S1", "ms": 1.1, "runs": 5, "tflops": 4000.0}  # the median, not the slow first round
    assert bad["what"] == "broken" and bad["error"] == "RuntimeError: no kernel for this shape" and "ms" not in bad
    assert b["ms"] == 2.0 and "tflops" not in b  # the case named no_flop_rate


def test_time_cases_spent_budget_skips_cases_and_stops_rounds(script, monkeypatch):
    monkeypatch.setattr(script, "event_ms", lambda fn: fn() or 1.0)
    checks = iter([False, True, False] + [True] * 10)  # case a in, case b out; round 1 runs, round 2 is out
    report = {"timing": []}
    script.time_cases([("a", lambda: None), ("b", lambda: None)], report, "S1", 1e9, lambda: next(checks),
                      iters=7, warmup=1, no_flop_rate="")
    a, b = report["timing"]
    assert a["runs"] == 1 and a["ms"] == 1.0
    assert b == {"what": "b", "shape": "S1", "skipped": "time budget"}
