"""Reading ONE transformer block from a local diffusers checkpoint, straight onto the target device.

A diffusers transformer folder holds `config.json` and either one `*.safetensors` file or an index
(`*.safetensors.index.json`: key -> shard file) and its shards. Only the shards that hold the block's
keys are opened, and only those tensors are read: a 1.3 GB MiniMax-H3 block out of a 66 GB model.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import UserError
from .folders import CONFIG_NAME, transformer_folder  # noqa: F401 (re-exported: block.py, the commands)



@dataclass(frozen=True)
class CheckpointLayout:
    """Where a transformer's tensors live: key -> shard path (one entry per key)."""

    key_to_file: dict[str, Path]

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return [key for key in self.key_to_file if key.startswith(prefix)]


@dataclass(frozen=True)
class LoadStats:
    """What reading the block cost: bytes as stored on disk, wall time, and the shards touched."""

    tensors: int
    bytes_read: int
    seconds: float
    shards: tuple[str, ...]

    @property
    def gbps(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict:
        return {"tensors": self.tensors, "bytes_read": self.bytes_read, "seconds": self.seconds,
                "gbps": self.gbps, "shards": list(self.shards)}


def read_layout(folder: Path) -> CheckpointLayout:
    """Key -> shard map from the folder's safetensors index, or from its single safetensors file."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise UserError(f"{folder} holds several safetensors indexes ({', '.join(p.name for p in indexes)}); keep one")
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"{indexes[0]} is not a safetensors index ({exc}); re-download it") from exc
        return CheckpointLayout({key: folder / name for key, name in weight_map.items()})
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        found = "no" if not files else f"{len(files)} un-indexed"
        raise UserError(f"{folder} has {found} safetensors files and no index; expected one file or an index.json")
    with _open_shard(files[0], "cpu") as f:
        return CheckpointLayout({key: files[0] for key in f.keys()})


def _open_shard(path: Path, device: str):
    if not path.is_file():
        raise UserError(f"shard {path.name} is missing from {path.parent}; download it again")
    try:
        return safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError) as exc:
        raise UserError(f"shard {path.name} is truncated or not a safetensors file ({exc}); download it again") from exc


def read_tensors(layout: CheckpointLayout, keys: list[str], device: torch.device,
                 dtype_of: "callable[[str], torch.dtype]") -> tuple[dict[str, torch.Tensor], LoadStats]:
    """Read `keys` onto `device`, each converted to `dtype_of(key)`; shards opened once each."""
    by_shard: dict[Path, list[str]] = defaultdict(list)
    for key in keys:
        by_shard[layout.key_to_file[key]].append(key)
    target = str(device) if device.type == "cuda" else "cpu"
    tensors: dict[str, torch.Tensor] = {}
    bytes_read = 0
    start = time.perf_counter()
    for shard, shard_keys in sorted(by_shard.items()):
        with _open_shard(shard, target) as f:
            missing = set(shard_keys) - set(f.keys())
            if missing:
                raise UserError(f"shard {shard.name} lacks {len(missing)} tensors its index lists "
                                f"(e.g. {sorted(missing)[0]}); the download is incomplete")
            for key in shard_keys:
                try:
                    stored = f.get_tensor(key)
                except (SafetensorError, OSError) as exc:
                    raise UserError(f"shard {shard.name} is truncated ({exc}); download it again") from exc
                bytes_read += stored.numel() * stored.element_size()
                tensors[key] = stored.to(device=device, dtype=dtype_of(key))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return tensors, LoadStats(len(tensors), bytes_read, seconds, tuple(p.name for p in sorted(by_shard)))


def count_blocks(layout: CheckpointLayout, key_template: str) -> int:
    """Number of blocks in the checkpoint: one past the largest index with a key `template.format(i)`."""
    head = key_template.split("{index}")[0]
    indices = {int(key[len(head):].split(".", 1)[0]) for key in layout.key_to_file
               if key.startswith(head) and key[len(head):].split(".", 1)[0].isdigit()}
    return max(indices) + 1 if indices else 0
