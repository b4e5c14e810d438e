"""Run folders appear whole or not at all, a run never deletes what it did not write, and two runs never fight over
one folder."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dit_accel import run_dir

from dit_accel.errors import UserError
from dit_accel.run_dir import StagedRun


def test_success_moves_the_staging_folder_into_place(tmp_path):
    with StagedRun(tmp_path / "run") as staging:
        (staging / "report.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    assert (tmp_path / "run" / "report.json").read_text() == "{}"


def test_failure_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with StagedRun(tmp_path / "run") as staging:
            (staging / "half.csv").write_text("a,b")
            raise RuntimeError("out of memory")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_folder_may_be_the_target(tmp_path):
    (tmp_path / "run").mkdir()
    with StagedRun(tmp_path / "run") as staging:
        (staging / "x").write_text("1")
    assert (tmp_path / "run" / "x").exists()


@pytest.mark.parametrize("target", [".", "outputs", "a_file"])
def test_existing_content_is_never_deleted(tmp_path, monkeypatch, target):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "earlier_run").mkdir()
    (tmp_path / "a_file").write_text("keep me")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError, match="runs never overwrite"):
        with StagedRun(tmp_path / target if target != "." else tmp_path):
            pass
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_failure_removes_the_folders_made_to_hold_the_run(tmp_path):
    with pytest.raises(RuntimeError):
        with StagedRun(tmp_path / "outputs" / "deep" / "run"):
            raise RuntimeError("bad input")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_another_live_run_is_writing_is_refused_in_one_line(tmp_path):
    other = run_dir._Claim(tmp_path / "run")  # what a live run holds while it writes `run`
    try:
        with pytest.raises(UserError, match=rf"another run \(process {os.getpid()}\) is writing .*run; pass --out"):
            with StagedRun(tmp_path / "run"):
                pass
        assert [p.name for p in tmp_path.iterdir()] == [".run.lock"]
    finally:
        other.release()
    assert list(tmp_path.iterdir()) == []


def test_a_default_name_moves_on_past_taken_and_claimed_folders(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "earlier").write_text("1")
    other = run_dir._Claim(tmp_path / "run-2")
    staged = StagedRun(tmp_path / "run", numbered=True)
    with staged as staging:
        (staging / "x").write_text("1")
    other.release()
    assert staged.final == tmp_path / "run-3" and (staged.final / "x").exists() and staged.moved_note is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run-3"]


def test_a_killed_runs_lock_file_is_removed_by_the_next_run(tmp_path):
    (tmp_path / ".old-run.lock").write_text("12345")  # nobody holds it: its run was killed
    with StagedRun(tmp_path / "new-run"):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["new-run"]


def test_a_folder_that_appears_while_the_run_writes_moves_the_results_to_a_visible_sibling(tmp_path):
    staged = StagedRun(tmp_path / "run")
    with staged as staging:
        (staging / "report.json").write_text("{}")
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "theirs").write_text("1")  # another host's run, or a user's copy
    assert staged.final == tmp_path / "run-2" and (staged.final / "report.json").exists()
    assert "appeared while this run wrote" in staged.moved_note
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run-2"]  # nothing hidden left


@pytest.mark.slow
def test_two_processes_started_together_never_collide(tmp_path):
    """Default-named runs both finish, in `run` and `run-2`; runs given the same --out: one wins, the other is
    refused in one line, and neither leaves a hidden folder."""
    code = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from dit_accel.errors import UserError
        from dit_accel.run_dir import StagedRun
        staged = StagedRun(Path(sys.argv[1]), numbered=sys.argv[2] == "numbered")
        try:
            with staged as staging:
                (staging / "report.json").write_text("{}")
                time.sleep(1.0)
        except UserError as exc:
            print("refused:", exc)
        else:
            print("wrote", staged.final)
    """)
    for mode, expected in (("numbered", ["run", "run-2"]), ("given", ["run"])):
        parent = tmp_path / mode
        procs = [subprocess.Popen([sys.executable, "-c", code, str(parent / "run"), mode], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outputs = [p.communicate(timeout=60) for p in procs]
        assert all(p.returncode == 0 for p in procs), outputs
        assert sorted(p.name for p in parent.iterdir()) == expected
        if mode == "given":
            assert sorted(out.split(":")[0].split()[0] for out, _ in outputs) == ["refused", "wrote"], outputs


@pytest.mark.parametrize("mask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600),
                                                          (0o002, 0o775, 0o664)])
def test_a_run_folder_and_its_files_follow_the_umask(tmp_path, mask, folder_mode, file_mode):
    """mkdtemp makes the staging folder 0700, and libraries write some files 0600 through temporary files (diffusers'
    safetensors): the finished run has the modes the user's umask gives, so colleagues can read shared results."""
    previous = os.umask(mask)
    try:
        with StagedRun(tmp_path / "run") as staging:
            (staging / "report.json").write_text("{}")
            (staging / "sub").mkdir()
            private = staging / "sub" / "weights.safetensors"
            private.write_bytes(b"w")
            private.chmod(0o600)
    finally:
        os.umask(previous)
    run = tmp_path / "run"
    assert run.stat().st_mode & 0o777 == folder_mode and (run / "sub").stat().st_mode & 0o777 == folder_mode
    assert {(p.name, p.stat().st_mode & 0o777) for p in run.rglob("*") if p.is_file()} == {
        ("report.json", file_mode), ("weights.safetensors", file_mode)}


def test_a_place_files_cannot_be_made_in_says_so_and_names_the_commands_own_option(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user writes anywhere (root): /proc stands in below")
        with pytest.raises(UserError, match=r"cannot write files in .*locked .*give another DIRECTORY"):
            with StagedRun(locked / "run", option="DIRECTORY"):
                pass
    finally:
        locked.chmod(0o700)


def test_proc_is_no_place_for_a_run_and_the_message_names_the_argument():
    with pytest.raises(UserError) as error:
        with StagedRun(Path("/proc/dit-accel-test"), option="DIRECTORY"):
            pass
    message = str(error.value)
    assert message.startswith("cannot write files in /proc (making .dit-accel-test.lock there failed")
    assert "give another DIRECTORY, a new folder where you can write" in message and "--out" not in message
