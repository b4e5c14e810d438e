"""Opening a diffusers pipeline folder from the local disk only, with one-line errors for bad folders.

A `DiffusionPipeline` folder (model_index.json `_class_name` a pipeline class of diffusers, e.g.
WanPipeline). Modular pipelines (MiniMax-H3: `_class_name` ends in `ModularPipeline`, or a
`_blocks_class_name` is present) are refused with one line: generate does not run them yet.
Everything is checked before a weight is read: the folder, model_index.json, the class, and one
sub-folder per component it lists.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..offload import stream_blocks

MODEL_INDEX = "model_index.json"


@dataclass(frozen=True)
class PipelineFolder:
    path: Path
    class_name: str
    components: dict[str, tuple[str, str]]  # name -> (library, class) for every component with weights or config

    @property
    def name(self) -> str:
        """A short tag for run folders: the class without 'Pipeline' (`Wan`, `MiniMaxH3`)."""
        tag = self.class_name.replace("ModularPipeline", "").replace("Pipeline", "")
        return (tag or self.path.name).lower()


def inspect_pipeline_folder(path: Path) -> PipelineFolder:
    """Check a pipeline folder without loading anything; UserError with what to do when it is not one."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"pipeline folder {path} does not exist; make one with `dit-accel make-tiny-pipeline wan {path}`")
    if not path.is_dir():
        raise UserError(f"--pipeline {path} is a file; pass the folder that holds model_index.json")
    index_path = path / MODEL_INDEX
    if not index_path.is_file():
        raise UserError(f"{path} has no {MODEL_INDEX}, so it is not a diffusers pipeline folder; "
                        f"pass the folder save_pretrained wrote")
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {index_path} ({exc}); re-save the pipeline") from exc
    class_name = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(class_name, str):
        raise UserError(f"{index_path} names no pipeline class (_class_name); re-save the pipeline")
    if class_name.endswith("ModularPipeline") or "_blocks_class_name" in index:
        raise UserError(f"{path} holds {class_name}, a modular pipeline; generate runs DiffusionPipelines "
                        f"(e.g. WanPipeline) and does not run modular ones (MiniMax-H3) yet")
    import diffusers

    if not hasattr(diffusers, class_name):
        raise UserError(f"{path}: pipeline class {class_name} is not in diffusers {diffusers.__version__}; "
                        f"upgrade diffusers or pass another folder")
    components: dict[str, tuple[str, str]] = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) < 2:
            continue
        library, cls = value[0], value[1]
        if library is None or cls is None:  # an optional component left empty (Wan's transformer_2)
            continue
        components[name] = (library, cls)
    missing = [name for name in components if not (path / name).is_dir()]
    if missing:
        raise UserError(f"{path} lacks the component folder(s) {', '.join(missing)} that {MODEL_INDEX} lists; "
                        f"copy them in or re-save the pipeline")
    return PipelineFolder(path, class_name, components)


STREAMED_COMPONENTS = ("transformer", "transformer_2")  # what --offload stream keeps off the GPU


def streamed_bytes(pipe) -> int:
    """Weight bytes that --offload stream copies to the GPU per denoising pass."""
    return sum(p.numel() * p.element_size() for name, component in pipe.components.items()
               if name in STREAMED_COMPONENTS and isinstance(component, torch.nn.Module)
               for p in component.parameters())


def quiet_library_progress() -> None:
    """Silence diffusers' and transformers' own loading/saving bars; generate draws its own."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def load_pipeline(folder: PipelineFolder, *, device: torch.device, dtype: torch.dtype, offload: str = "resident"):
    """The pipeline on `device` in `dtype`, read from the local folder only (never a hub).

    offload "stream": the transformer(s) stay in pinned host memory and stream onto `device` one
    block at a time (`offload.stream_blocks`); every other component goes to `device`."""
    quiet_library_progress()
    from diffusers import DiffusionPipeline

    try:
        pipe = DiffusionPipeline.from_pretrained(str(folder.path), dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load the pipeline in {folder.path}: {first_line}") from exc
    if offload == "stream":
        for name, component in pipe.components.items():
            if isinstance(component, torch.nn.Module):
                if name in STREAMED_COMPONENTS:
                    stream_blocks(component, device)
                else:
                    component.to(device)
    else:
        pipe.to(device)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)  # generate draws its own bar over the steps
    return pipe
