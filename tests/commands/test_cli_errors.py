"""The command line's hard edges: every bad input is one `error:` line and exit status 2 with
no folder left (visible or hidden); Ctrl-C and SIGTERM end a run with one line (130, 143) and leave
nothing; `--help` imports neither torch nor diffusers; a normal run prints no third-party noise."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from dit_accel import cli, run_dir
from dit_accel.cli import main
from dit_accel.device import pick_device
from dit_accel.errors import UserError
from dit_accel.run_dir import StagedRun, remove_stale_staging

FAST = ["--seq-len", "64", "--runs", "2", "--warmup", "1"]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a GPU")


def _sigint_as_in_a_terminal() -> None:
    """A command started in a terminal gets Ctrl-C; a suite started in the background (`cmd &` without job control,
    nohup) ignores SIGINT, and its children would inherit that and never see the signal these tests send."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _python(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_as_in_a_terminal, **kwargs)


def _wait_until_loaded(proc: subprocess.Popen, library: str, timeout: float = 60) -> None:
    """Until the process has mapped a shared library whose path holds `library` (Linux /proc)."""
    deadline = time.monotonic() + timeout
    maps = Path(f"/proc/{proc.pid}/maps")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the process ended (status {proc.returncode}) before loading {library}")
        try:
            if library in maps.read_text():
                return
        except OSError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"{library} not loaded within {timeout} s")


def _dit_accel(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dit_accel", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def _assert_one_error_line(result, outputs: Path, words: str, *, ran: bool = False) -> None:
    """Exit 2, one line `error: ...` holding `words` on stderr, and no `outputs` folder (a run removes the folders
    it made to hold its output). Nothing on stdout either, unless the run had started (`ran`: profile-block's
    progress lines)."""
    exit_code = getattr(result, "exit_code", getattr(result, "returncode", None))
    assert exit_code == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr
    assert (ran or result.stdout == "") and "Traceback" not in result.stdout, result.stdout
    assert not outputs.exists(), list(outputs.iterdir())


@pytest.fixture
def no_blocks_checkpoint(tmp_path, tiny_wan) -> Path:
    """The tiny Wan transformer's config beside a safetensors file with no block tensor in it."""
    folder = tmp_path / "no_blocks"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_wan / "transformer" / "config.json").read_text())
    save_file({"proj_out.weight": torch.zeros(4, 128)}, str(folder / "diffusion_pytorch_model.safetensors"))
    return folder


# --- bad input: one line, exit 2, nothing written -------------------------------------------------

@pytest.mark.parametrize("command, words", [
    (["profile-block", *FAST, "--device", "tpu"], "--device tpu: dit-accel runs on CUDA GPUs and on the CPU"),
    (["profile-block", *FAST, "--device", "meta"], "--device meta: meta tensors hold no data"),
    (["profile-block", *FAST, "--device", "cuda:x"], "pass cuda, cuda:N or cpu"),
])
def test_profile_block_refuses_devices_it_does_not_run_on(tmp_path, command, words):
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, [*command, "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, words)


@pytest.mark.parametrize("device, words", [("tpu", "not on 'tpu'"), ("meta", "meta tensors hold no data")])
def test_generate_refuses_devices_it_does_not_run_on(tiny_wan, tmp_path, device, words):
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--device", device,
                                       "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, words)


def test_pick_device_takes_cuda_and_cpu_only():
    assert pick_device("cpu") == torch.device("cpu")
    for name in ("tpu", "meta", "mps", "cpu:0", "CUDA", "cuda:-1"):
        with pytest.raises(UserError, match="pass cuda, cuda:N or cpu"):
            pick_device(name)


def test_a_checkpoint_on_the_cpu_runs_a_short_video_and_a_size_its_rope_cannot_reach_is_one_line(tiny_wan, tmp_path):
    """On the CPU a checkpoint's block runs the short video a scaled-down run uses (its weights are full size), and
    says so; a video the user asks for that the tiny model's RoPE table (64 positions per axis) cannot reach is one
    line naming that video (it was `IndexError: index 64 is out of bounds` deep in the block)."""
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, ["profile-block", "--checkpoint", str(tiny_wan), "--device", "cpu",
                                       "--runs", "1", "--warmup", "0", "--out", str(outputs / "ok")])
    assert result.exit_code == 0, result.output
    assert "CPU RUN (the checkpoint's block, a short video)" in result.output and "9 frames 64x64" in result.output
    result = CliRunner().invoke(main, ["profile-block", "--checkpoint", str(tiny_wan), "--device", "cpu", "--frames",
                                       "81", "--height", "720", "--width", "1280", "--runs", "1", "--warmup", "0",
                                       "--out", str(outputs / "run")])
    assert result.exit_code == 2 and "the 81 frames 720x1280 workload" in result.output
    assert "needs 80 RoPE positions on one axis" in result.output
    assert "--frames 9 --height 64 --width 64" in result.output
    assert not (outputs / "run").exists()


@pytest.mark.parametrize("case, words", [
    ("a file", "is a file; pass the folder that holds it"),
    ("no blocks", "holds no Wan 2.x block tensors (no key starts with 'blocks.0.')"),
])
def test_checkpoints_that_are_not_block_folders_are_one_line(tiny_wan, no_blocks_checkpoint, tmp_path, case, words):
    checkpoint = tiny_wan / "transformer" / "config.json" if case == "a file" else no_blocks_checkpoint
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, ["profile-block", "--checkpoint", str(checkpoint), "--device", "cpu", *FAST,
                                       "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, words, ran=case == "no blocks")  # found when the block loads
    assert "0..-1" not in result.output


def test_a_size_the_wan_pipeline_refuses_is_one_line(tiny_wan, tmp_path, capfd):
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--height", "50", "--width", "50",
                                       "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, "WanPipeline refused the request: `height` and `width` have to be "
                                            "divisible by 16 but are 50 and 50; change --frames, --height or --width")
    assert "Traceback" not in capfd.readouterr().err


def test_a_transformer_torch_compile_cannot_compile_is_one_line(tiny_wan, tmp_path, capfd, monkeypatch):
    """generate --compile when torch.compile fails on the pipeline's transformer (inductor raising here)."""
    import torch._inductor.compile_fx as compile_fx

    def fails(*args, **kwargs):
        raise RuntimeError("Polyfill handler for this method is missing\nsecond line")

    monkeypatch.setattr(compile_fx, "compile_fx", fails)
    torch._dynamo.reset()
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--compile", "--steps", "1",
                                       "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, "the pipeline's transformer: torch", ran=True)
    assert "Polyfill handler" in result.stderr and "(--compile, +compile)" in result.stderr
    assert "Traceback" not in capfd.readouterr().err


def test_a_video_no_host_holds_is_refused_before_the_pipeline_loads(tiny_wan, tmp_path):
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--frames", "100000", "--height",
                                       "4096", "--width", "4096", "--steps", "1", "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, "1 decoded video(s) of 100000 frames at 4096x4096 alone need")
    assert "lower --frames (at most" in result.output


@NO_GPU
def test_compare_on_the_cpu_says_the_fp8_candidate_is_the_default(tiny_wan, tmp_path):
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--compare", "bf16",
                                       "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, "(the default --attn with --compare)")
    assert "--attn fp8 cannot run" not in result.output
    assert "pass --attn with an attention that runs here" in result.output


@NO_GPU
def test_a_reference_that_cannot_run_names_compare(tiny_wan, tmp_path):
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_wan), "--compare", "fp8", "--attn", "bf16",
                                       "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, "--compare fp8 cannot run here")


def test_the_h3_refusal_is_our_line_alone_without_diffusers_block_traceback(tiny_h3, tmp_path, capfd):
    """diffusers' modular pipeline logs the failing block's traceback (17 lines, to its own stderr handler)
    before raising; only our line is left."""
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, ["generate", "--pipeline", str(tiny_h3), "--frames", "3",
                                       "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, "refused the request: MiniMax-H3 generates between 5.0 and 15.0 seconds")
    captured = capfd.readouterr()
    assert "Error in block" not in captured.err and "Traceback" not in captured.err, captured.err


@NO_GPU
def test_an_unavailable_backend_is_refused_before_the_first_is_profiled(tmp_path):
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, ["profile-block", *FAST, "--device", "cpu", "--compare-attn", "native,fp8",
                                       "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, "attention backend 'fp8' is unavailable here")
    assert "profil" not in result.output.split("error:")[0]


def test_closed_option_sets_are_click_choices():
    """Options with a closed set of values list them in --help and refuse others as one line."""
    for name in ("profile-block", "generate", "bench-attention", "make-tiny-pipeline"):
        command = main.get_command(None, name)
        for option in ("--model", "--dtype", "--offload", "--linear", "--compile"):
            param = next((p for p in command.params if option in getattr(p, "opts", ())), None)
            if param is not None:
                assert isinstance(param.type, click.Choice), (name, option)


# --- signals ------------------------------------------------------------------------------------

def _wait_for_staging(parent: Path, proc: subprocess.Popen, timeout: float = 90) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        staging = [p for p in parent.iterdir() if p.name.endswith(".partial")] if parent.exists() else []
        if staging:
            return staging[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("no staging folder appeared")


@pytest.mark.slow
@pytest.mark.parametrize("signum, exit_code, line", [(signal.SIGTERM, 143, "terminated"),
                                                     (signal.SIGINT, 130, "interrupted")])
def test_a_signal_mid_run_leaves_nothing_behind(tmp_path, signum, exit_code, line):
    """`kill` (SIGTERM) or Ctrl-C (SIGINT) while the block is profiled: one line, the conventional exit
    status, and neither the run folder, nor its hidden staging folder, nor the folder made to hold them remains."""
    outputs = tmp_path / "outputs"
    proc = _python("-m", "dit_accel", "profile-block", "--device", "cpu", "--seq-len", "64", "--warmup", "0",
                   "--runs", "1000000", "--out", str(outputs / "run"))
    _wait_for_staging(outputs, proc)
    time.sleep(0.5)
    proc.send_signal(signum)
    try:
        _, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running 30 s after {signum!r}")
    assert proc.returncode == exit_code, stderr
    assert stderr.strip().splitlines()[-1] == line and "Traceback" not in stderr, stderr
    assert list(tmp_path.iterdir()) == []  # nor the outputs/ folder the run made to hold them


def test_ctrl_c_during_the_imports_is_one_line(tmp_path):
    """Ctrl-C in the first seconds, while torch and diffusers import: `interrupted`, 130, no traceback."""
    proc = _python("-m", "dit_accel", "profile-block", "--device", "cpu", "--out", str(tmp_path / "run"))
    _wait_until_loaded(proc, "libtorch")  # inside the imports: torch's library is mapped, the run not begun
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.strip() == "interrupted" and stdout == "", (stdout, stderr)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_runs_staging_folder_is_removed_by_the_next_run(tmp_path):
    """SIGKILL (or the out-of-memory killer) leaves `.<name>.<pid>.<random>.partial`; the next run into the
    same parent removes it once its process is gone, and leaves a live run's and any other folder alone."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    host = run_dir._host()
    stale = tmp_path / f".old-run.{host}-{dead_pid}.abcd_123.partial"
    live = tmp_path / f".other-run.{host}-{os.getppid()}.zyxw9876.partial"
    elsewhere = tmp_path / f".old-run.another-host-{dead_pid}.abcd_123.partial"  # its pid means nothing here
    unrelated = [tmp_path / ".old-run.abcdefgh.partial", tmp_path / ".git", tmp_path / "earlier_run", elsewhere]
    for folder in (stale, live, *unrelated):
        folder.mkdir()
    (stale / "ops.csv").write_text("half")
    with StagedRun(tmp_path / "new-run") as staging:
        assert staging.name.startswith(f".new-run.{host}-{os.getpid()}.")
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "new-run", *(p.name for p in unrelated)])
    assert remove_stale_staging(tmp_path) == []


# --- --help is fast; a normal run is quiet -------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["generate", "--pipeline", "/nonexistent"], "pipeline folder /nonexistent does not exist"),
    (["profile-block", "--checkpoint", "/nonexistent"], "checkpoint folder /nonexistent does not exist"),
])
def test_a_wrong_path_is_refused_before_diffusers_loads(args, words):
    """The mistakes a user makes most cost a second: a wrong folder is checked before the imports that take
    several (`cli.LazyCommand.precheck`)."""
    code = ("import sys; from click.testing import CliRunner; from dit_accel.cli import main; "
            f"r = CliRunner().invoke(main, {args!r}); print(r.exit_code); print(r.output); "
            "print('LOADED', 'diffusers.models.modeling_utils' in sys.modules)")
    proc = _python("-c", code)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert stdout.startswith("2\n") and words in stdout and "LOADED False" in stdout, stdout


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["make-tiny-pipeline", "--help"],
                                  ["bench-attention", "--help"], ["profile-block", "--help"], ["compare", "--help"],
                                  ["plan", "--help"]])
def test_help_imports_neither_torch_nor_diffusers(args):
    code = ("import sys; from click.testing import CliRunner; from dit_accel.cli import main; "
            f"r = CliRunner().invoke(main, {args!r}); assert r.exit_code == 0, r.output; print(r.output); "
            "heavy = sorted(m for m in ('torch', 'diffusers', 'numpy', 'matplotlib') if m in sys.modules); "
            "print('HEAVY', heavy)")
    proc = _python("-c", code)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "HEAVY []" in stdout, stdout
    if args == ["--help"]:
        for name in cli.COMMANDS:
            assert (f"  {name} " in stdout) == cli.COMMANDS[name].exists(), (name, stdout)


def test_the_listed_short_help_is_the_commands_own():
    """`dit-accel --help` reads each command's summary from its source; it must be what click would show."""
    ctx = click.Context(main)
    for name in main.list_commands(ctx):
        assert cli._short_help_from_source(cli.COMMANDS[name], 60) == main.get_command(ctx, name).get_short_help_str(60)


def test_a_command_whose_module_is_not_written_yet_is_not_listed(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "later", cli.LazyCommand("no_such_module", "later"))
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "later" not in result.output and "profile-block" in result.output
    result = CliRunner().invoke(main, ["later"])
    assert result.exit_code == 2 and "No such command 'later'" in result.output


def test_the_attention_help_text_is_the_vocabularys():
    from dit_accel.attention.backends import BACKENDS
    from dit_accel.commands.options import ATTENTION_BACKENDS, ATTENTION_HELP
    from dit_accel.patching.recipe import ALIASES, OPTIONS

    assert ATTENTION_BACKENDS == tuple(BACKENDS)
    assert ATTENTION_HELP.startswith(", ".join(BACKENDS) + ";")
    assert all(f"+{option}" in ATTENTION_HELP for option in OPTIONS) and all(a in ATTENTION_HELP for a in ALIASES)


def test_the_model_family_choices_are_the_adapters():
    from dit_accel.adapters import DEFAULT_FAMILY as LIBRARY_DEFAULT
    from dit_accel.adapters import FAMILIES
    from dit_accel.commands.options import DEFAULT_FAMILY, MODEL_FAMILIES

    assert MODEL_FAMILIES == tuple(FAMILIES) and DEFAULT_FAMILY == LIBRARY_DEFAULT


@pytest.mark.slow
@NO_GPU
def test_a_run_prints_no_third_party_noise(tiny_wan, tmp_path):
    """In a fresh process (diffusers, torchao and torch imported anew), an error found after the imports
    is the only line on stderr: no torchao `.so` notices, pytree warnings or diffusers warnings."""
    result = _dit_accel("generate", "--pipeline", tiny_wan, "--device", "tpu", "--out", tmp_path / "run")
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.startswith("error: --device tpu") and result.stderr.count("\n") == 1, result.stderr


def test_the_stage_table_names_the_attention_and_the_dtype_apart():
    from dit_accel.commands.generate import _stage_table
    from dit_accel.pipelines.stage_timer import StageTimes

    run = SimpleNamespace(attention="bf16", times=StageTimes(text_encoding_ms=1.0, step_ms=[2.0], total_ms=4.0))
    table = _stage_table([run], "float32")
    assert table.columns[1].header == "bf16 attention, ms"
    assert "dtype float32" in table.title


def test_the_bench_attention_help_values_are_the_librarys():
    from dit_accel.attention import bench
    from dit_accel.commands import bench_attention as command

    assert (command.HELP_GPU_DEFAULT_SHAPE, command.HELP_CPU_DEFAULT_SHAPE) == (bench.GPU_DEFAULT_SHAPE,
                                                                                 bench.CPU_DEFAULT_SHAPE)
    assert command.INPUT_CHOICES == tuple(bench.INPUT_KINDS)


# --- messages that say the true reason and only the options the command has ---------------------------------

@pytest.mark.parametrize("command, words", [
    (["profile-block", "--attn", "math", "--compare-attn", "native,math"], "it has math already, so drop --attn"),
    (["profile-block", "--attn", "math", "--compare-attn", "native"], "add math to it and drop --attn"),
    (["profile-block", "--block", "-1"], "--block -1: block indices count from 0 (the first block); give 0 to 49"),
    (["profile-block", "--attn", "native+rope+rope"], "'native+rope+rope' names +rope more than once"),
    (["profile-block", "--compare-attn", "cudnn,fp8+fp8-linear+fp8-linear"], "names +fp8-linear more than once"),
])
def test_profile_block_messages_name_the_true_reason(tmp_path, command, words):
    outputs = tmp_path / "outputs"
    result = CliRunner().invoke(main, [*command, *FAST, "--out", str(outputs / "run")])
    _assert_one_error_line(result, outputs, words)


def test_make_tiny_pipeline_in_a_place_it_cannot_write_names_its_own_argument(tmp_path):
    result = CliRunner().invoke(main, ["make-tiny-pipeline", "wan", "/proc/dit-accel-tiny"])
    _assert_one_error_line(result, tmp_path / "nothing", "cannot write files in /proc")
    assert "give another DIRECTORY" in result.stderr and "--out" not in result.stderr


def test_a_video_size_off_the_patch_grid_is_stated(tmp_path):
    result = CliRunner().invoke(main, ["profile-block", "--frames", "9", "--height", "33", "--width", "64", "--runs",
                                       "1", "--warmup", "0", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    source = json.loads((tmp_path / "run" / "report.json").read_text())["workload"]["source"]
    assert source.endswith("33x64 runs as 32x64: the patch grid takes multiples of 32x32 pixels")


def test_the_python_api_rejects_wrong_types_in_one_line():
    from dit_accel.kernels.fp8_attention import Fp8AttentionUnsupported, fp8_attention
    from dit_accel.patching import apply_recipe, parse_recipe, patch_attention
    from testing import wan_block_and_inputs

    block, _ = wan_block_and_inputs()
    for call, words in [(lambda: parse_recipe(None), "a recipe is a name such as"),
                        (lambda: patch_attention(block, 5), "backend takes an attention name"),
                        (lambda: patch_attention(block, "math", keep_blocks="0"), "keep_blocks takes a tuple"),
                        (lambda: patch_attention(block, "math", keep_steps=None), "keep_steps takes a tuple"),
                        (lambda: patch_attention(None, "math"), "cannot patch a NoneType"),
                        (lambda: apply_recipe(block, 3).__enter__(), "a recipe is a name such as")]:
        with pytest.raises(UserError, match=words) as error:
            call()
        assert "\n" not in str(error.value)
    with pytest.raises(Fp8AttentionUnsupported, match="q is a list; pass a torch.Tensor"):
        fp8_attention([1], [2], [3])
    with apply_recipe(block, "math") as applied:  # a name works where a Recipe does
        assert applied.recipe == parse_recipe("math")


@NO_GPU
def test_patch_attention_refuses_a_backend_the_device_cannot_run_when_the_patch_is_made():
    """As the README and the docstring say: fp8 on the CPU is refused at the call, in one line, nothing patched."""
    from dit_accel.patching import patch_attention
    from testing import wan_block_and_inputs

    block, inputs = wan_block_and_inputs()
    before = block(*inputs)
    with pytest.raises(UserError, match="attention backend 'fp8' is unavailable here: the FP8 kernel needs a CUDA GPU"):
        patch_attention(block, "fp8")
    assert torch.equal(block(*inputs), before)
