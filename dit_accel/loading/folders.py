"""Where a model or pipeline is on disk, checked from its files alone: no torch, no diffusers, so a wrong path is
refused in one line before the command loads them (`cli`'s prechecks)."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError

CONFIG_NAME = "config.json"
MODEL_INDEX = "model_index.json"
MODULAR_INDEX = "modular_model_index.json"


def transformer_folder(path: Path) -> Path:
    """The transformer folder itself, or the `transformer/` folder of a pipeline folder."""
    path = Path(path)
    if path.is_file():
        raise UserError(f"--checkpoint {path} is a file; pass the folder that holds it, with config.json and the "
                        f"safetensors (a diffusers transformer folder, or a pipeline folder)")
    if not path.is_dir():
        raise UserError(f"checkpoint folder {path} does not exist; pass a local diffusers transformer folder")
    if not (path / CONFIG_NAME).is_file() and (path / "transformer" / CONFIG_NAME).is_file():
        return path / "transformer"
    if not (path / CONFIG_NAME).is_file():
        raise UserError(f"{path} has no {CONFIG_NAME}; pass a diffusers transformer folder (or a pipeline folder)")
    return path


def pipeline_index(path: Path) -> Path:
    """The index file of a diffusers pipeline folder (modular or not); UserError with what to do when `path` is not
    one."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"pipeline folder {path} does not exist; make one with "
                        f"`dit-accel make-tiny-pipeline wan {path}`")
    if not path.is_dir():
        raise UserError(f"--pipeline {path} is a file; pass the folder that holds model_index.json")
    for name in (MODULAR_INDEX, MODEL_INDEX):
        if (path / name).is_file():
            return path / name
    raise UserError(f"{path} has no {MODEL_INDEX} (nor {MODULAR_INDEX}), so it is not a diffusers pipeline "
                    f"folder; pass the folder save_pretrained wrote")
