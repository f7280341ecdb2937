"""Argument conversion shared by the attention ops.

Index arguments (block tables, context lengths, slot mappings, query offsets, block-id pairs)
may be torch tensors or numpy integer arrays: the int32 buffers that
``BlockSpaceManager.append_slots_batch`` fills go straight in, wrapped by ``torch.from_numpy``
(a CPU tensor sharing their memory, no copy). Anything else is an
:class:`~pagedkv.errors.ArgumentTypeError` that says what to pass, never an ``AttributeError``
from deep inside torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import ArgumentTypeError

# numpy dtypes whose torch counterparts the ops index with (torch's unsigned 16/32/64-bit
# types are not usable as indices).
_NUMPY_INDEX_DTYPES = frozenset(
    np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8)
)

_HINT = (
    "pass a torch.Tensor or a numpy integer array (the int32 buffers append_slots_batch "
    "fills are accepted as they are: torch.from_numpy shares their memory)"
)


def index_tensor(value: Any, name: str) -> torch.Tensor:
    """``value`` as an integer-typed tensor: a tensor as it is, a numpy array without a copy."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return _from_numpy(value, name)
    raise ArgumentTypeError(f"{name}: {_HINT}; got {type(value).__name__}")


def tensor(value: Any, name: str) -> torch.Tensor:
    """``value`` itself if it is a tensor (K/V data: no implicit conversion)."""
    if isinstance(value, torch.Tensor):
        return value
    hint = " (torch.from_numpy(array) wraps a numpy array)" if isinstance(value, np.ndarray) else ""
    raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}{hint}")


def _from_numpy(array: np.ndarray, name: str) -> torch.Tensor:
    if array.dtype.newbyteorder("=") not in _NUMPY_INDEX_DTYPES:
        raise ArgumentTypeError(
            f"{name} must be an int32 or int64 array (int8/int16/uint8 also work), "
            f"got numpy {array.dtype}"
        )
    if not (array.flags.writeable and array.dtype.isnative and min(array.strides, default=0) >= 0):
        # torch.from_numpy refuses negative strides and foreign byte order and warns on
        # read-only memory: such an array is copied (once) instead of shared.
        array = np.array(array, dtype=array.dtype.newbyteorder("="))
    return torch.from_numpy(array)
