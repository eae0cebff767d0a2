"""Dtype table and zero-copy views of tensors as unsigned-integer element arrays.

The codec works on bit patterns, never on float values: every dtype is viewed as unsigned
integers of its item size, so NaN payloads, -0.0 and subnormals survive untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DType:
    code: int  # wire code in the payload index (docs/FORMAT.md)
    name: str  # safetensors-style name
    torch: torch.dtype
    itemsize: int


def _table() -> list[DType]:
    rows = [
        (0, "BOOL", "bool"), (1, "U8", "uint8"), (2, "I8", "int8"), (3, "I16", "int16"),
        (4, "I32", "int32"), (5, "I64", "int64"), (6, "F16", "float16"), (7, "BF16", "bfloat16"),
        (8, "F32", "float32"), (9, "F64", "float64"), (10, "F8_E4M3", "float8_e4m3fn"),
        (11, "F8_E5M2", "float8_e5m2"), (12, "U16", "uint16"), (13, "U32", "uint32"),
        (14, "U64", "uint64"), (15, "C64", "complex64"), (16, "F8_E4M3FNUZ", "float8_e4m3fnuz"),
        (17, "F8_E5M2FNUZ", "float8_e5m2fnuz"), (18, "F8_E8M0", "float8_e8m0fnu"),
        (19, "C128", "complex128"),
    ]
    out = []
    for code, name, attr in rows:
        dt = getattr(torch, attr, None)
        if dt is not None:
            out.append(DType(code, name, dt, torch.empty((), dtype=dt).element_size()))
    return out


DTYPES: tuple[DType, ...] = tuple(_table())
BY_CODE: dict[int, DType] = {d.code: d for d in DTYPES}
BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in DTYPES}
BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
BF16 = BY_TORCH[torch.bfloat16]
F16 = BY_TORCH[torch.float16]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size views torch has
_SIGNED_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # their numpy twins (every torch converts them)


def _unsigned_torch() -> dict[int, torch.dtype]:
    """Unsigned torch dtypes that convert to numpy, by size (uint16 and up from torch 2.3): a
    view through them skips one numpy view per tensor in element_view."""
    out = {}
    for size, name in ((1, "uint8"), (2, "uint16"), (4, "uint32"), (8, "uint64")):
        dt = getattr(torch, name, None)
        try:
            if dt is not None and torch.zeros(1, dtype=dt).numpy().dtype == np.dtype(_UINT[size]):
                out[size] = dt
        except (TypeError, RuntimeError):  # this torch has the dtype but not its numpy conversion
            pass
    return out


_UNSIGNED_TORCH = _unsigned_torch()


def dtype_of(t: torch.Tensor, name: str) -> DType:
    try:
        return BY_TORCH[t.dtype]
    except KeyError:
        from .errors import CheckpointMismatchError

        raise CheckpointMismatchError(f"tensor {name!r}: unsupported dtype {t.dtype}") from None


def check_shape_limits(name: str, shape: tuple[int, ...], max_ndim: int, max_numel: int) -> None:
    """ValueError naming the tensor when a format could not hold its shape (its decoders would refuse it):
    more than `max_ndim` dims, or a dim, the product, or the product of the non-zero dims over `max_numel`.
    Encoders call it so that nothing they write is refused by every reader."""
    if len(shape) > max_ndim:
        raise ValueError(f"tensor {name[:200]!r}: {len(shape)} dims, the format holds at most {max_ndim}")
    spanned = 1
    for d in shape:
        spanned *= max(d, 1)
    if spanned > max_numel:
        raise ValueError(f"tensor {name[:200]!r}: shape {list(shape)} spans over {max_numel} elements, the "
                         f"format's limit")


def element_view(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer view of a tensor's elements (a copy only if it is on a device, strided, or a lazy
    conjugate or negative view).

    Item sizes without a numpy unsigned type (complex128) are viewed as uint64 pairs.
    """
    if t.is_conj() or t.is_neg():  # lazy conjugate / negative views: their bits are those they materialise to
        t = t.resolve_conj().resolve_neg()
    size = t.element_size()
    if t.is_cpu and size in _SIGNED and t.is_contiguous():  # the common case: 2 torch calls
        if t.requires_grad:
            t = t.detach()
        unsigned = _UNSIGNED_TORCH.get(size)
        if unsigned is not None:
            return t.view(unsigned).numpy().ravel()
        return t.view(_SIGNED[size]).numpy().reshape(-1).view(_UINT[size])
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    raw = flat.view(torch.uint8).numpy()
    return raw.view(_UINT[size] if size in _UINT else np.uint64)


def element_dtype(dt: DType) -> np.dtype:
    return np.dtype(_UINT.get(dt.itemsize, np.uint64))


def elements_per_item(dt: DType) -> int:
    """How many numpy elements one tensor item occupies in `element_view` (2 for complex128)."""
    return 1 if dt.itemsize in _UINT else dt.itemsize // 8


def tensor_from_elements(elems: np.ndarray, dt: DType, shape: tuple[int, ...], *, copy: bool = True) -> torch.Tensor:
    """A CPU tensor of `dt` and `shape` over `elems`' bytes (a copy unless `copy=False` hands them over)."""
    if elems.size == 0:
        return torch.empty(shape, dtype=dt.torch)
    if dt.itemsize in _SIGNED_NP and elems.dtype.itemsize == dt.itemsize:
        # shaped in numpy, then one same-size view in torch: a torch reshape costs more than all this
        arr = np.ascontiguousarray(elems).reshape(shape).view(_SIGNED_NP[dt.itemsize])
        return torch.from_numpy(arr.copy() if copy else arr).view(dt.torch)
    raw = np.ascontiguousarray(elems).view(np.uint8)
    t = torch.from_numpy(raw.copy() if copy else raw)
    return t.view(dt.torch).reshape(shape)


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Bit-exact equality of two checkpoints: the same names, dtypes, shapes and bytes (NaN payloads and
    -0.0 included, where == on floats would differ); for checking a reconstruction by hand."""
    if set(a) != set(b):
        return False
    for k, x in a.items():
        y = b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
                           y.detach().cpu().contiguous().reshape(-1).view(torch.uint8)):
            return False
    return True
