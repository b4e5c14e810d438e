"""The device check scripts on the CPU: check_fp8_sm90's arguments and variant names, check_fp8_attention's timing
report entries and report file, check_compile.per_call_rounds, compile_startup's suite; CUDA events, the host
clock and subprocesses replaced by ones the test controls (the interleaved timer: tests/test_timing_interleaved.py)."""
import importlib.util
import json
import os

import pytest
import torch

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


@pytest.fixture
def sm90_script():
    return load_script("check_fp8_sm90")


def test_variants_are_named_by_their_configurations_label(sm90_script):
    from dit_accel.kernels.fp8_attention.config import Sm90Config

    variants = sm90_script.parse_variants("default,128x2,192x2s,128x2p2re2w3,128x3p", sm_count=132)
    assert variants == ["default", Sm90Config(), Sm90Config(tile_n=192, two_level_pv=False),
                        Sm90Config(persistent_ctas=132, q_stages=2, pv_row_sum=True, fma_exp2_tiles=2,
                                   consumer_warpgroups=3),
                        Sm90Config(num_stages=3, persistent_ctas=132)]
    assert [sm90_script.variant_name(v) for v in variants] == ["default", "128x2", "192x2s", "128x2p2re2w3", "128x3p"]
    # "default" is what fp8_attention runs (`tuning.sm90_config`): persistent at D = 64 and at D = 128 up to
    # 12288 keys, the tensor core's row sums at D = 64; no "w": the head dim's warpgroups.
    name = sm90_script.variant_name
    assert (name("default", 128, 132, 4096), name("default", 128, 132, 30272), name("default", 64, 132, 30272)) == (
        "default=128x2p", "default=128x2", "default=128x2pr")
    assert sm90_script.resolve("default", 64, 78, 30272).persistent_ctas == 78
    assert sm90_script.resolve(variants[1], 64, 78, 30272) is variants[1]


def test_bad_variants_stop_the_script_before_any_gpu_work(sm90_script, capsys):
    args = sm90_script.parse_args(["--out", "x", "--variants", "default,128x2p", "--head-dim", "64"])
    assert (args.variants, args.head_dim, args.seq_lens, args.budget_s) == ("default,128x2p", 64, "30272", 300.0)
    for variants, reason in (("128x2,12x", "bad variant '12x'"), ("128x2sr", "pv_row_sum needs two_level_pv"),
                             ("100x2", "tile_n must be a multiple")):
        with pytest.raises(SystemExit):
            sm90_script.parse_args(["--out", "x", "--variants", variants])
        assert reason in capsys.readouterr().err


def timed_cases(durations: dict[str, list[float]]):
    """Cases whose k-th call moves the returned clock by durations[name][k] seconds, and that clock."""
    now, calls = [0.0], {name: 0 for name in durations}

    def case(name):
        def call():
            now[0] += durations[name][calls[name]]
            calls[name] += 1
        return call

    return {name: case(name) for name in durations}, lambda: now[0]


def test_timing_entries_report_each_case_its_median_rate_error_or_skip(script):
    """Cases timed on the CPU with a clock each call moves: a's timed calls take 1, 3 and 2 ms (median 2 ms;
    4.4e12 FLOP: 2200 TFLOP/s); a case that raises gets its error; b, a case no_flop_rate names, no rate."""
    cases, clock = timed_cases({"a": [0.0, 0.5, 0.001, 0.5, 0.003, 0.5, 0.002], "b": [0.0] + [0.5, 0.004] * 3})

    def broken():
        raise RuntimeError("no kernel for this shape")

    cases = {"a": cases["a"], "broken": broken, "b": cases["b"]}
    entries = script.timing_entries(cases, "S1", 4.4e12, budget_s=None, rounds=3, warmup=1, no_flop_rate=("b",),
                                    device=torch.device("cpu"), clock=clock)
    a, bad, b = entries
    assert a == {"what": "a", "shape": "S1", "ms": 2.0, "runs": 3, "tflops": 2200.0}
    assert bad == {"what": "broken", "shape": "S1", "error": "RuntimeError: no kernel for this shape"}
    assert b == {"what": "b", "shape": "S1", "ms": 4.0, "runs": 3}
    # a's first round (100 s untimed, then its sample) spends the 1.5 s budget: c never gets a sample.
    cases, clock = timed_cases({"a": [0.0, 100.0, 0.002], "c": [0.0]})
    a, c = script.timing_entries(cases, "S1", 1e9, budget_s=1.5, rounds=3, warmup=1, no_flop_rate=(),
                                 device=torch.device("cpu"), clock=clock)
    assert (a["ms"], a["runs"]) == (2.0, 1)
    assert c == {"what": "c", "shape": "S1", "skipped": "time budget"}


def test_write_report_stamps_the_wall_time(script, tmp_path, monkeypatch):
    monkeypatch.setattr(script.time, "time", lambda: 112.34)
    script.write_report({"timing": []}, str(tmp_path), "check.json", started=100.0)
    assert json.loads((tmp_path / "check.json").read_text()) == {"timing": [], "wall_s": 12.3}


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


def test_the_compile_startup_suite_names_real_cases_and_shares_caches_only_with_a_next_run(tmp_path, monkeypatch):
    """Every case is a family and a recipe the package knows; each runs in its own process on its own caches, but
    a "next run" on the caches its first run left; a failed case is reported, not fatal."""
    from dit_accel.adapters import adapter_for_preset
    from dit_accel.patching.recipe import parse_recipe

    startup = load_script("compile_startup")
    for _, model, seq_len, recipe, _ in startup.SUITE:
        adapter_for_preset(model).workload_from_seq_len(seq_len, 1)
        assert parse_recipe(recipe).compile_mode == "default"
    seen = []

    def fake_run(command, env, capture_output, text):
        case = command[command.index("--out") + 1]
        seen.append((os.path.basename(case), env["TORCHINDUCTOR_CACHE_DIR"], env["CUTE_DSL_CACHE_DIR"]))
        failed = "wan-ours-next-run" in case
        if not failed:
            with open(case, "w") as f:
                json.dump({"phases_s": {"block: first call": 1.5}}, f)
        return type("Done", (), {"returncode": 1 if failed else 0, "stdout": "", "stderr": "boom" if failed else ""})()

    monkeypatch.setattr(startup.subprocess, "run", fake_run)
    startup.run_suite(tmp_path, ["h3-ours", "h3-ours-next-run", "wan-ours", "wan-ours-next-run"])
    caches = {name: inductor for name, inductor, _ in seen}
    assert caches["h3-ours.json"] == caches["h3-ours-next-run.json"] != caches["wan-ours.json"]
    assert all(inductor.startswith(str(tmp_path)) and cute.startswith(str(tmp_path)) for _, inductor, cute in seen)
    results = json.loads((tmp_path / "suite.json").read_text())
    assert [(r["case"], r["exit"]) for r in results] == [("h3-ours", 0), ("h3-ours-next-run", 0), ("wan-ours", 0),
                                                         ("wan-ours-next-run", 1)]
    assert results[0]["phases_s"] == {"block: first call": 1.5}
    assert (tmp_path / "wan-ours-next-run.log").read_text() == "boom"


def test_the_quantization_study_reproduces_the_kernels_emulation_for_todays_scheme():
    """The study's 'today' row is the kernel's scheme: its error equals emulate_fp8_attention's (same 128-key
    blocks, last to first) on the same inputs; K smoothing leaves unquantized attention unchanged; int8 per block
    beats e4m3 per head on N(0,1), as the study reports."""
    from dit_accel.attention.reference import random_qkv, reference_attention, rel_rms_err
    from dit_accel.kernels.fp8_attention.emulation import emulate_fp8_attention

    study = load_script("qk_quantization_study")
    for d in (128, 64):
        q, k, v = random_qkv(1, 300, 300, 2, d, device="cpu", seed=d)
        emulated = emulate_fp8_attention(q, k, v, out_dtype=torch.float64, block_keys=128, reverse=True,
                                         rounded_row_sum=d == 64)
        today = study.scheme_error(q, k, v, study.SCHEMES["e4m3 per head (today)"])
        assert today == pytest.approx(rel_rms_err(emulated, reference_attention(q, k, v)), rel=1e-4)
        assert study.scheme_error(q, k, v, study.SCHEMES["int8 per block + K smoothing"]) < 0.8 * today
        everything = torch.arange(300)
        assert study.scheme_error(q, k, v, study.SCHEMES["int8 per thread"], everything) == pytest.approx(
            study.scheme_error(q, k, v, study.SCHEMES["int8 per thread"]), rel=1e-12)
    # SageAttention2's per-thread groups: rows r and r + 8 of each 16 queries; keys 2t, 2t + 1 mod 8 of each 128
    assert study.thread_groups(32, study.PER_THREAD_Q).tolist() == [*range(8), *range(8), *range(8, 16),
                                                                     *range(8, 16)]
    assert study.thread_groups(136, study.PER_THREAD_K).tolist()[:10] == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    assert study.thread_groups(136, study.PER_THREAD_K).tolist()[128:] == [4, 4, 5, 5, 6, 6, 7, 7]
    q, k, v = (x.double() for x in random_qkv(1, 64, 64, 1, 64, device="cpu", seed=1))
    shifted = k + torch.randn(1, 1, 1, 64, dtype=torch.float64)  # a mean shared by every key
    torch.testing.assert_close(reference_attention(q, shifted, v), reference_attention(q, k, v))
