"""Reading each rank's slices of a full checkpoint without materializing full tensors.

Sources: an in-memory state dict, a ``.safetensors`` file, or a directory of
HF-style sharded safetensors files with ``model.safetensors.index.json``. For
files, each rank reads only its own slice of each tensor (safetensors
slicing), so peak memory stays near the shard size.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Sequence, Union

import torch

from .errors import ShardingError
from .mesh import MeshInfo
from .placements import Pl
from .spec import chunk, chunk_index, shard_factor

__all__ = ["rank_slices", "SliceReader", "open_checkpoint"]

Source = Union[Mapping[str, torch.Tensor], str, os.PathLike]


def rank_slices(shape: Sequence[int], pls: Sequence[Pl], info: MeshInfo) -> tuple[slice, ...]:
    """The index of this rank's shard of a tensor of global ``shape`` laid out per ``pls``
    (``torch.chunk`` pieces, so an uneven split gives the last rank the shorter piece)."""
    out = []
    for d, size in enumerate(shape):
        f = shard_factor(pls, info.sizes, d)
        start, length = chunk(int(size), f, chunk_index(pls, info.sizes, info.coords, d))
        out.append(slice(start, start + length))
    return tuple(out)


class SliceReader:
    """Uniform access to tensor shapes and slices of a checkpoint source."""

    def __init__(self, src: Source):
        self._mem: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, str] = {}
        if isinstance(src, Mapping):
            self._mem = src
            return
        path = os.fspath(src)
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self._files = {k: os.path.join(path, v) for k, v in weight_map.items()}
            else:
                single = os.path.join(path, "model.safetensors")
                if not os.path.exists(single):
                    raise ShardingError(
                        f"{path} has neither model.safetensors.index.json nor model.safetensors; point "
                        f"load_full_state_dict at a safetensors file or an HF-style checkpoint directory"
                    )
                path = single
        if not self._files:
            if not os.path.exists(path):
                raise ShardingError(f"checkpoint {path} does not exist; pass an existing .safetensors file or directory")
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                self._files = {k: path for k in f.keys()}

    def keys(self) -> list[str]:
        return list(self._mem.keys()) if self._mem is not None else list(self._files)

    def read(self, name: str, index: tuple[slice, ...], expect_shape: Sequence[int]) -> torch.Tensor:
        if self._mem is not None:
            full = self._mem[name]
            shape = tuple(full.shape)
        else:
            from safetensors import safe_open

            with safe_open(self._files[name], framework="pt") as f:
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                if shape == tuple(expect_shape):
                    return sl[index] if index else sl[:]
        if shape != tuple(expect_shape):
            raise ShardingError(
                f"load_full_state_dict: {name} has shape {shape}, expected {tuple(expect_shape)}; "
                f"load a checkpoint of the same model config"
            )
        return full[index]


def open_checkpoint(src: Source) -> SliceReader:
    return SliceReader(src)
