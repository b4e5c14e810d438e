"""The device check scripts' timing helpers (check_fp8_attention.time_cases, check_compile.per_call_rounds),
with CUDA events and the host clock replaced by clocks the test controls."""
import importlib.util
import os

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), os.pardir, "scripts")


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def script():
    return load_script("check_fp8_attention")


def test_time_cases_interleaves_rounds_and_warms_each_case_before_its_sample(script, monkeypatch):
    calls = []  # every call of a case's fn, and "timed" where a timed call began
    ms_of = {"a": [5.0, 1.0, 1.0, 1.2, 1.1], "b": [9.0, 2.0, 2.0, 2.0, 2.4]}  # a slow first round for both

    def event_ms(fn):
        calls.append("timed")
        name = fn()
        return ms_of[name][calls.count(name) // 2 - warmup]  # this case's timed calls so far, from 0

    def case(name):
        return lambda: calls.append(name) or name

    def broken():
        raise RuntimeError("no kernel for this shape")

    warmup = 2
    monkeypatch.setattr(script, "event_ms", event_ms)
    report = {"timing": []}
    script.time_cases([("a", case("a")), ("broken", broken), ("b", case("b"))], report, "S1", 4.4e12,
                      lambda: False, iters=5, warmup=warmup, no_flop_rate="b")
    # warm-up: each case twice; then per round each case once untimed and once timed, a before b
    assert calls == ["a", "a", "b", "b"] + ["a", "timed", "a", "b", "timed", "b"] * 5
    a, bad, b = report["timing"]
    assert a == {"what": "a", "shape": "S1", "ms": 1.1, "runs": 5, "tflops": 4000.0}  # the median, not the slow first round
    assert bad["what"] == "broken" and bad["error"] == "RuntimeError: no kernel for this shape" and "ms" not in bad
    assert b["ms"] == 2.0 and "tflops" not in b  # the case named no_flop_rate


def test_time_cases_stops_where_the_budget_runs_out(script, monkeypatch):
    """A clock that only moves forward: each fn call costs 1 s of a 10 s budget. The warm-up of both cases
    fits (4 s), the rounds stop inside the second (each sample costs 2 s: a at 4 and 8 s, b at 6 s, then
    b's second finds the budget spent), and each case keeps what it has."""
    clock = [0.0]

    def fn():
        clock[0] += 1.0

    monkeypatch.setattr(script, "event_ms", lambda f: f() or 1.0)
    report = {"timing": []}
    script.time_cases([("a", fn), ("b", fn)], report, "S1", 1e9, lambda: clock[0] >= 10.0, iters=7, warmup=2,
                      no_flop_rate="")
    a, b = report["timing"]
    assert (a["runs"], b["runs"]) == (2, 1)
    report = {"timing": []}
    clock[0] = 8.0  # room for one warm-up only
    script.time_cases([("a", fn), ("b", fn)], report, "S1", 1e9, lambda: clock[0] >= 10.0, iters=7, warmup=2,
                      no_flop_rate="")
    a, b = report["timing"]
    assert a == {"what": "a", "shape": "S1", "skipped": "time budget"}  # warmed up, then no time for a sample
    assert b == {"what": "b", "shape": "S1", "skipped": "time budget"}


def test_per_call_rounds_interleaves_candidates_so_a_drift_falls_on_each(monkeypatch):
    """Two candidates that cost the same, on a host that slows down after three of ten rounds: timed one
    after the other the first would read faster; in interleaved rounds both read the same."""
    module = load_script("check_compile")
    now, calls, syncs = [0.0], [], []

    def candidate(name):
        def call():
            calls.append(name)
            now[0] += 1e-6 if len(calls) <= 100 else 2e-6  # 40 warm-up calls, 3 rounds, then the host slows
        return call

    result = module.per_call_rounds({"a": candidate("a"), "b": candidate("b")}, lambda: syncs.append(len(calls)),
                                    calls=100, rounds=10, clock=lambda: now[0])
    assert calls[:40] == ["a"] * 20 + ["b"] * 20
    assert calls[40:] == (["a"] * 10 + ["b"] * 10) * 10
    assert syncs == [40] + [40 + 10 * i for i in range(1, 21)]  # after the warm-up, then after each candidate's turn
    assert result["a"] == result["b"] == {"median_us": 2.0, "min_us": 1.0, "max_us": 2.0}
