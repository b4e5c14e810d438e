"""Run folders appear whole or not at all, and a run never deletes what it did not write."""
import pytest

from dit_accel.errors import UserError
from dit_accel.run_dir import staged_run_dir


def test_success_moves_the_staging_folder_into_place(tmp_path):
    with staged_run_dir(tmp_path / "run") as staging:
        (staging / "report.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    assert (tmp_path / "run" / "report.json").read_text() == "{}"


def test_failure_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with staged_run_dir(tmp_path / "run") as staging:
            (staging / "half.csv").write_text("a,b")
            raise RuntimeError("out of memory")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_folder_may_be_the_target(tmp_path):
    (tmp_path / "run").mkdir()
    with staged_run_dir(tmp_path / "run") as staging:
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
        with staged_run_dir(tmp_path / target if target != "." else tmp_path):
            pass
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
