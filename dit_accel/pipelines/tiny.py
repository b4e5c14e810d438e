"""The tiny pipelines `make-tiny-pipeline` builds, and the run defaults it leaves beside them.

A tiny pipeline folder is an ordinary diffusers folder plus `dit_accel.json`, which holds the
frames / height / width / steps that make `generate` finish in seconds on a CPU; `generate` reads
it when present and the command line overrides it. Diffusers ignores the extra file.

Every folder is built in a staging folder that is renamed into place (nothing half-written is left
behind); a modular pipeline's index records the folder it was saved into, so it is pointed at the
final folder before the rename.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..errors import UserError
from ..run_dir import StagedRun

DEFAULTS_FILE = "dit_accel.json"


def _wan(directory: Path, seed: int, transformer_config: dict | None) -> dict:
    from .tiny_wan import save_tiny_wan

    return save_tiny_wan(directory, seed, transformer_config)


def _h3(directory: Path, seed: int, transformer_config: dict | None) -> dict:
    from .tiny_h3 import save_tiny_h3

    return save_tiny_h3(directory, seed)


def _skyreels_v2(directory: Path, seed: int, transformer_config: dict | None) -> dict:
    from .tiny_skyreels_v2 import save_tiny_skyreels_v2

    return save_tiny_skyreels_v2(directory, seed, transformer_config)


def _cogvideox(directory: Path, seed: int, transformer_config: dict | None) -> dict:
    from .tiny_cogvideox import save_tiny_cogvideox

    return save_tiny_cogvideox(directory, seed, transformer_config)


# dit-accel's family names (adapters/families.py) -> builders; each imports its module (and diffusers) when called.
TINY_BUILDERS: dict[str, Callable[[Path, int, dict | None], dict]] = {
    "wan": _wan, "h3": _h3, "skyreels-v2": _skyreels_v2, "cogvideox": _cogvideox}
TINY_LATENT_CHANNELS = 16  # what every tiny VAE encodes to (Wan 2.1's and CogVideoX's latents)


def transformer_preset(family: str, name: str) -> dict:
    """The config of `family`'s preset `name` (`dit-accel models`), for a real-size transformer in a tiny pipeline;
    UserError, one line, where the family has no such preset or its latents are not the tiny VAE's."""
    if family == "h3":
        raise UserError("--transformer: MiniMax-H3's transformer is 65 GB; profile-block measures it block by block "
                        "(and generate runs a real H3 folder); build the tiny h3 pipeline without --transformer")
    from ..adapters import FAMILIES

    presets = FAMILIES[family].presets
    if name not in presets:
        raise UserError(f"--transformer {name}: {family} has no such preset; choose one of: {', '.join(presets)}")
    config = dict(presets[name].config)
    if config.get("in_channels") != TINY_LATENT_CHANNELS:
        raise UserError(f"--transformer {name}: its latents have {config.get('in_channels')} channels and the tiny "
                        f"{family} VAE makes {TINY_LATENT_CHANNELS}; choose one of the other presets")
    return config


def make_tiny_pipeline(family: str, directory: Path, seed: int = 0, transformer: str | None = None) -> dict:
    """Build the tiny `family` pipeline into `directory` (created; must be empty or absent); `transformer`: a preset
    of the family whose real-size transformer (random weights, bf16) replaces the tiny one, the text encoder, the
    tokenizer and the VAE staying tiny (the pipeline's own video size and steps are then generate's defaults)."""
    if family not in TINY_BUILDERS:
        raise UserError(f"no tiny pipeline for {family!r}; choose one of: {', '.join(TINY_BUILDERS)}")
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise UserError(f"{directory} exists and is not an empty folder; give another DIRECTORY, a new folder")
    transformer_config = transformer_preset(family, transformer) if transformer else None
    from .pipeline_folder import quiet_libraries

    quiet_libraries()
    staged = StagedRun(directory, option="DIRECTORY")
    with staged as staging:  # a failed build leaves nothing behind
        info = TINY_BUILDERS[family](staging, seed, transformer_config)
        if transformer:  # a real-size transformer runs the pipeline's own video size and steps, not the tiny ones
            info = {**info, "defaults": {"transformer": transformer}}
        (staging / DEFAULTS_FILE).write_text(json.dumps({"family": family, "seed": seed, **info["defaults"]},
                                                        indent=2) + "\n")
    _point_modular_index_at(staged.final, staging)
    return {**info, "folder": staged.final, "moved_note": staged.moved_note}


def _point_modular_index_at(folder: Path, saved_to: Path) -> None:
    """`ModularPipeline.save_pretrained` records the folder it saved into as every component's
    `pretrained_model_name_or_path` in modular_model_index.json; the build saved into a staging folder that
    became `folder`, so those entries are rewritten to `folder` (absolute, as diffusers writes them). A
    DiffusionPipeline folder has no such index and nothing to rewrite."""
    from .pipeline_folder import MODULAR_INDEX

    index_path = folder / MODULAR_INDEX
    if not index_path.is_file():
        return
    index = json.loads(index_path.read_text())
    for entry in index.values():
        spec = entry[2] if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict) else {}
        if spec.get("pretrained_model_name_or_path") == str(saved_to):
            spec["pretrained_model_name_or_path"] = str(folder.resolve())
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def read_run_defaults(directory: Path) -> dict:
    """The defaults a tiny pipeline folder suggests ({} for any other folder)."""
    try:
        data = json.loads((Path(directory) / DEFAULTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: data[k] for k in ("frames", "height", "width", "steps", "guidance") if k in data}
