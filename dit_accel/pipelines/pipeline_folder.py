"""Opening a diffusers pipeline folder from the local disk only, with one-line errors for bad folders.

Two kinds of folder. A `DiffusionPipeline` folder: model_index.json, whose `_class_name` is a pipeline
class of diffusers (e.g. WanPipeline). A modular pipeline folder: modular_model_index.json, which
`ModularPipeline.save_pretrained` writes (MiniMax-H3: `MiniMaxH3ModularPipeline` over `MiniMaxH3Blocks`).
A modular pipeline runs one workflow of its blocks; generate runs the text-to-video one (`MODULAR_WORKFLOWS`)
and loads only the components that workflow uses (not H3's second transformer, `transformer_ref`).

Everything is checked before a weight is read: the folder, the index, the class, and one sub-folder
per component (every component model_index.json lists; for a modular folder, every one its workflow
loads).
"""
from __future__ import annotations

import importlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..loading.folders import MODEL_INDEX, MODULAR_INDEX, pipeline_index
from ..loading.offload import stack_bytes, stream_blocks


# The modular pipelines generate runs, and the workflow of their blocks it runs: text (and nothing else) in.
MODULAR_WORKFLOWS = {"MiniMaxH3ModularPipeline": "t2va"}


@dataclass(frozen=True)
class PipelineFolder:
    path: Path
    class_name: str
    components: dict[str, tuple[str, str]]  # name -> (library, class) for every component with weights or config
    workflow: str | None = None  # a modular pipeline's workflow; None for a DiffusionPipeline

    @property
    def name(self) -> str:
        """A short tag for run folders: the class without 'Pipeline' (`Wan`, `MiniMaxH3`)."""
        tag = self.class_name.replace("ModularPipeline", "").replace("Pipeline", "")
        return (tag or self.path.name).lower()

    @property
    def modular(self) -> bool:
        return self.workflow is not None


def _read_index(index_path: Path) -> tuple[dict, str]:
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {index_path} ({exc}); re-save the pipeline") from exc
    class_name = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(class_name, str):
        raise UserError(f"{index_path} names no pipeline class (_class_name); re-save the pipeline")
    return index, class_name


def _listed_components(index: dict) -> dict[str, tuple[str, str]]:
    """Index entries [library, class] (model_index.json) or [library, class, loading spec] (modular)."""
    components: dict[str, tuple[str, str]] = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) < 2:
            continue
        library, cls = value[0], value[1]
        # An optional component left empty (Wan's transformer_2, H3's transformer_ref).
        if library is None or cls is None:
            continue
        components[name] = (library, cls)
    return components


def _workflow_components(path: Path, index: dict, class_name: str) -> tuple[str, list[str]]:
    """The workflow generate runs in this modular pipeline, and the components it loads from the folder."""
    import diffusers

    workflow = MODULAR_WORKFLOWS.get(class_name)
    if workflow is None:
        raise UserError(f"{path} holds {class_name}, a modular pipeline generate does not run; it runs "
                        f"{', '.join(MODULAR_WORKFLOWS)} among modular pipelines")
    blocks_class = getattr(diffusers, str(index.get("_blocks_class_name")), None)
    if blocks_class is None:
        raise UserError(f"{path}: {MODULAR_INDEX} names blocks {index.get('_blocks_class_name')!r}, which diffusers "
                        f"{diffusers.__version__} lacks; upgrade diffusers or re-save the pipeline")
    specs = blocks_class().get_workflow(workflow).expected_components
    return workflow, [spec.name for spec in specs if spec.default_creation_method == "from_pretrained"]


def inspect_pipeline_folder(path: Path) -> PipelineFolder:
    """Check a pipeline folder without loading anything; UserError with what to do when it is not one."""
    path = Path(path)
    index_path = pipeline_index(path)
    modular = index_path.name == MODULAR_INDEX
    index, class_name = _read_index(index_path)
    if not modular and (class_name.endswith("ModularPipeline") or "_blocks_class_name" in index):
        raise UserError(f"{index_path} names {class_name}, a modular pipeline, whose index diffusers reads from "
                        f"{MODULAR_INDEX}; rename the file to {MODULAR_INDEX}")
    import diffusers

    if not hasattr(diffusers, class_name):
        raise UserError(f"{path}: pipeline class {class_name} is not in diffusers {diffusers.__version__}; "
                        f"upgrade diffusers or pass another folder")
    components = _listed_components(index)
    workflow = None
    if modular:
        workflow, needed = _workflow_components(path, index, class_name)
        missing = [name for name in needed if name not in components or not (path / name).is_dir()]
        what = f"that its {workflow} workflow loads"
    else:
        missing = [name for name in components if not (path / name).is_dir()]
        what = f"that {MODEL_INDEX} lists"
    if missing:
        raise UserError(f"{path} lacks the component folder(s) {', '.join(missing)} {what}; "
                        f"copy them in or re-save the pipeline")
    return PipelineFolder(path, class_name, components, workflow)


STREAMED_COMPONENTS = ("transformer", "transformer_2")  # what --offload stream keeps off the GPU


def streamed_bytes(pipe) -> int:
    """Weight bytes that --offload stream copies to the GPU per denoising pass: the streamed
    components' block stacks (the rest of them stays on the GPU, `offload.stream_blocks`)."""
    return sum(stack_bytes(component) for name, component in pipe.components.items()
               if name in STREAMED_COMPONENTS and isinstance(component, torch.nn.Module))


def quiet_libraries() -> None:
    """Silence diffusers' and transformers' own loading/saving bars (generate draws its own), and torch's
    deprecation warning about `weight_norm`, which diffusers' H3 audio VAE raises on every build: the
    user can do nothing about either."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=r"`torch\.nn\.utils\.weight_norm` is deprecated", category=FutureWarning)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """A library's error message on one line (some put the reason on the second, e.g. a missing torchvision)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _load_modular(folder: PipelineFolder, dtype: torch.dtype):
    """The modular pipeline with its workflow's components, each read from the folder itself.

    Components load one by one (not through `load_components`, which turns a failure into a warning and
    leaves the component empty), so a broken one is one error line. Each loads from `folder.path`
    whatever its recorded `pretrained_model_name_or_path` says, so a copied or moved folder reads its own
    files and never falls back to another folder or to a hub."""
    from diffusers import ModularPipeline

    # The tiny H3 folder's processor is defined in tiny_h3; diffusers resolves a component class from
    # outside its own libraries only among the modules already imported.
    importlib.import_module(f"{__package__}.tiny_h3")
    try:
        pipe = ModularPipeline.from_pretrained(str(folder.path), workflow=folder.workflow, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot load the pipeline in {folder.path}: {_one_line(exc)}") from exc
    loaded = {}
    for name in pipe.pretrained_component_names:
        try:
            loaded[name] = pipe.get_component_spec(name).load(
                pretrained_model_name_or_path=str(folder.path), subfolder=name, dtype=dtype, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load {name} of the pipeline in {folder.path}: {_one_line(exc)}") from exc
    pipe.update_components(**loaded)
    return pipe


def load_pipeline(folder: PipelineFolder, *, device: torch.device, dtype: torch.dtype, offload: str = "resident"):
    """The pipeline on `device` in `dtype`, read from the local folder only (never a hub).

    offload "stream": the transformer(s) stay in pinned host memory and stream onto `device` one
    block at a time (`offload.stream_blocks`); every other component goes to `device`."""
    quiet_libraries()
    if folder.modular:
        pipe = _load_modular(folder, dtype)
    else:
        from diffusers import DiffusionPipeline

        try:
            pipe = DiffusionPipeline.from_pretrained(str(folder.path), dtype=dtype, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"cannot load the pipeline in {folder.path}: {_one_line(exc)}") from exc
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
