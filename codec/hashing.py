"""Tensor digests: xxh3-128 over dtype, shape and raw bytes.

xxh3 runs at memory speed on one core, so verifying every reconstruction costs less than
copying it. Dtype and shape are hashed too: the
same bytes read as another tensor must not verify.

Compiled kernels can feed a digest themselves (`Running`): the xxhash wheel's extension exports
the xxHash C API, and a kernel calls XXH3_128bits_update through its address, passed in as an
integer (a baked-in address would not survive numba's on-disk cache). A kernel then hashes
each few KiB of a tensor right after scanning or writing it, while it is in L1, with no Python
call per part. Where the symbols are missing or disagree with the Python binding (checked once
at import), `NATIVE` is None and callers hash from Python instead: same digests, slower.

A kernel that hashes many tensors in one call also resets and finishes digests itself
(`hash_reset`, `hash_digest`, with `NATIVE.functions()`), so no Python runs per tensor.
XXH3_128bits_digest returns a 16-byte struct by value; the kernels call it only where the C
ABI returns that in two registers (`KERNEL_DIGESTS`, checked at import like the rest).
"""

from __future__ import annotations

import ctypes
import importlib
import platform

import numba as nb
import numpy as np
import xxhash
from llvmlite import ir
from numba import types
from codec._intrinsic import typed_intrinsic

DIGEST_SIZE = 16


def header_bytes(dtype_name: str, shape: tuple[int, ...]) -> bytes:
    """What a tensor's digest hashes before its elements: its dtype and shape."""
    return f"{dtype_name}{list(shape)}".encode()


def digester(dtype_name: str, shape: tuple[int, ...]) -> xxhash.xxh3_128:
    """A tensor's running digest: `feed` it the tensor's elements in order, in any pieces (xxh3
    streams: the digest does not depend on how the bytes were split)."""
    h = xxhash.xxh3_128()
    h.update(header_bytes(dtype_name, shape))
    return h


def feed(h: xxhash.xxh3_128, elems: np.ndarray) -> None:
    h.update(np.ascontiguousarray(elems).data.cast("B"))  # .data: the array's memoryview


def digest_elements(dtype_name: str, shape: tuple[int, ...], elems: np.ndarray) -> bytes:
    h = digester(dtype_name, shape)
    feed(h, elems)
    return h.digest()


# ---------------------------------------------------------------- digests fed by compiled kernels

class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


class _Native:
    """The xxHash C API inside the xxhash wheel's extension (xxhash.h: XXH3_createState,
    XXH3_128bits_reset, XXH3_128bits_update, XXH3_128bits_digest, XXH3_freeState; and
    xxh_x86dispatch.h's XXH3_128bits_update_dispatch where the wheel has it)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self.create = lib.XXH3_createState
        self.create.restype = ctypes.c_void_p
        self.create.argtypes = []
        self.free = lib.XXH3_freeState
        self.free.argtypes = [ctypes.c_void_p]
        self.reset = lib.XXH3_128bits_reset
        self.reset.argtypes = [ctypes.c_void_p]
        # the wheel's runtime-dispatched update (AVX-512 / AVX2 where the CPU has them) is what
        # the binding calls: 2x the plain one's speed here
        self.update = getattr(lib, "XXH3_128bits_update_dispatch", None) or lib.XXH3_128bits_update
        self.update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self.update.restype = ctypes.c_int
        self.digest = lib.XXH3_128bits_digest
        self.digest.argtypes = [ctypes.c_void_p]
        self.digest.restype = _Hash128
        address = ctypes.cast(self.update, ctypes.c_void_p).value
        if not address:  # _load_native falls back to the binding
            raise OSError(f"{path}: XXH3_128bits_update has no address")
        self.update_address: int = address

    def feed(self, state: int, elems: np.ndarray) -> None:
        """Feeds the XXH3 `state` `elems`' bytes, from Python."""
        a = np.ascontiguousarray(elems)
        self.update(state, a.ctypes.data, a.nbytes)

    def digest_bytes(self, state: int) -> bytes:
        """`state`'s 16-byte digest (big-endian high then low half, as xxhash's digest())."""
        h = self.digest(state)
        return h.high64.to_bytes(8, "big") + h.low64.to_bytes(8, "big")

    def functions(self) -> np.ndarray:
        """(reset, update, digest) addresses for `hash_reset`, `hash_update` and `hash_digest`."""
        return np.array([ctypes.cast(f, ctypes.c_void_p).value for f in (self.reset, self.update, self.digest)],
                        np.uintp)


class Scratch:
    """Two XXH3 states for a kernel that hashes many tensors one after another (it resets them
    per tensor): `states` holds their addresses. Freed with the object."""

    __slots__ = ("_native", "states")

    def __init__(self, native: _Native) -> None:
        self._native = native
        self.states = np.zeros(2, np.uintp)
        for i in range(2):
            state = native.create()
            if not state:
                raise MemoryError("XXH3_createState failed")
            self.states[i] = state

    def __del__(self) -> None:
        for state in getattr(self, "states", ()):
            if state:
                self._native.free(int(state))
        self.states = np.zeros(0, np.uintp)


class Running:
    """A tensor's digest in progress, for a compiled kernel to feed with `hash_update`
    (`function`, `state`); its header (dtype and shape) is hashed on creation."""

    __slots__ = ("_native", "state", "function")

    def __init__(self, dtype_name: str, shape: tuple[int, ...], native: _Native) -> None:
        self._native = native
        self.state = native.create()
        if not self.state:
            raise MemoryError("XXH3_createState failed")
        self.function = native.update_address
        native.reset(self.state)
        header = header_bytes(dtype_name, shape)
        native.update(self.state, header, len(header))

    def update(self, elems: np.ndarray) -> None:
        """Feeds `elems` from Python: the parts of a tensor that no kernel wrote."""
        self._native.feed(self.state, elems)

    def digest(self) -> bytes:
        """The 16-byte digest (big-endian high then low half, as xxhash's digest())."""
        return self._native.digest_bytes(self.state)

    def __del__(self) -> None:
        if getattr(self, "state", None):
            self._native.free(self.state)
            self.state = None


@typed_intrinsic
def hash_update(typingctx, function, state, arr, start, stop):
    """Feed arr[start:stop] (a contiguous 1-d array) to the running digest `state` through the
    XXH3_128bits_update at address `function` (a `Running`'s fields). Returns its error code."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C"):
        return None
    sig = types.int32(types.uintp, types.uintp, arr, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        fn, st, ary, lo, hi = args
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [i8p, i8p, ir.IntType(64)])
        aty = signature.args[2]
        data = context.make_array(aty)(context, builder, value=ary).data
        item = context.get_abi_sizeof(context.get_data_type(aty.dtype))
        ptr = builder.bitcast(builder.gep(data, [lo]), i8p)
        size = builder.mul(builder.sub(hi, lo), ir.Constant(ir.IntType(64), item))
        return builder.call(builder.inttoptr(fn, fnty.as_pointer()), [builder.inttoptr(st, i8p), ptr, size])

    return sig, codegen


@typed_intrinsic
def hash_reset(typingctx, function, state):
    """Start `state` afresh through the XXH3_128bits_reset at address `function`."""
    sig = types.int32(types.uintp, types.uintp)

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [i8p])
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [builder.inttoptr(args[1], i8p)])

    return sig, codegen


@typed_intrinsic
def hash_digest(typingctx, function, state):
    """(low, high) 64-bit halves of `state`'s digest through the XXH3_128bits_digest at address
    `function`. Its XXH128_hash_t comes back by value: in two registers on the System V x86-64
    and AArch64 ABIs (`KERNEL_DIGESTS` holds where that is checked)."""
    sig = types.UniTuple(types.uint64, 2)(types.uintp, types.uintp)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.LiteralStructType([i64, i64]), [i8p])
        pair = builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [builder.inttoptr(args[1], i8p)])
        return context.make_tuple(builder, signature.return_type,
                                  [builder.extract_value(pair, 0), builder.extract_value(pair, 1)])

    return sig, codegen


def digest_bytes(halves: np.ndarray) -> bytes:
    """Digests from rows of (low, high) halves (`hash_digest`), each as `digest()` writes it
    (high half first, big-endian), back to back."""
    return np.ascontiguousarray(np.asarray(halves, np.uint64).reshape(-1, 2)[:, ::-1]).astype(">u8").tobytes()


@nb.njit(cache=True, nogil=True)
def _whole_digest(functions, state, header, arr):
    """A digest made entirely inside a kernel (the self-test of `hash_reset` and `hash_digest`)."""
    hash_reset(functions[0], state)
    hash_update(functions[1], state, header, 0, header.size)
    hash_update(functions[1], state, arr, 0, arr.size)
    return hash_digest(functions[2], state)


@nb.njit(cache=True, nogil=True)
def _feed_parts(function, state, arr, part):
    """arr fed in parts of `part` elements (the self-test's split)."""
    for s in range(0, arr.size, part):
        hash_update(function, state, arr, s, min(s + part, arr.size))


def _load_native() -> _Native | None:
    """The C API if the xxhash wheel exports it and it agrees with the binding (else None)."""
    try:
        path = importlib.import_module("xxhash._xxhash").__file__  # the binding's C extension
        if path is None:  # not loaded from a file: no library to open
            return None
        native = _Native(path)
    except (ImportError, OSError, AttributeError, TypeError):
        return None
    rng = np.random.default_rng(0)
    for size in (0, 5, 300, 4099):
        data = rng.integers(0, 1 << 16, size, dtype=np.uint16)
        running = Running("BF16", (size,), native)
        _feed_parts(np.uintp(running.function), np.uintp(running.state), data, 1000)
        if running.digest() != digest_elements("BF16", (size,), data):
            return None
    return native


NATIVE: _Native | None = _load_native()


def _kernel_digests() -> bool:
    """Whether kernels may finish digests themselves (`hash_digest`): the C ABI returns a 16-byte
    struct in two registers here, and digests made so agree with the binding's."""
    if NATIVE is None or platform.system() == "Windows":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return False
    scratch = Scratch(NATIVE)
    functions = NATIVE.functions()
    rng = np.random.default_rng(1)
    for size in (0, 3, 4099):
        data = rng.integers(0, 1 << 16, size, dtype=np.uint16)
        header = np.frombuffer(header_bytes("BF16", (size,)), np.uint8)
        got = digest_bytes(np.array(_whole_digest(functions, scratch.states[0], header, data), np.uint64))
        if got != digest_elements("BF16", (size,), data):
            return False
    return True


KERNEL_DIGESTS: bool = _kernel_digests()


class KernelDigests:
    """What a kernel that digests many tensors itself takes (`hash_reset`, `hash_update`,
    `hash_digest`): `functions` (empty without headers: the kernel then hashes nothing), two
    XXH3 `states` (freed with the object), and the tensors' headers (`header_bytes`) back to
    back, tensor i's at headers[offsets[i]:offsets[i + 1]]."""

    __slots__ = ("_scratch", "functions", "states", "headers", "offsets")

    def __init__(self, headers: list[bytes] | None, count: int) -> None:
        self._scratch = None
        self.functions = np.zeros(0, np.uintp)
        self.states = np.zeros(2, np.uintp)
        self.headers = np.zeros(0, np.uint8)
        self.offsets = np.zeros(count + 1, np.int64)
        if headers is None:
            return
        if not KERNEL_DIGESTS or NATIVE is None:  # KERNEL_DIGESTS implies NATIVE
            raise ValueError("kernels cannot finish digests on this platform (hashing.KERNEL_DIGESTS)")
        self._scratch = Scratch(NATIVE)
        self.functions, self.states = NATIVE.functions(), self._scratch.states
        self.headers = np.frombuffer(b"".join(headers), np.uint8)
        np.cumsum([len(h) for h in headers], out=self.offsets[1:])


def running(dtype_name: str, shape: tuple[int, ...]) -> Running | None:
    """A digest for a kernel to feed, or None where kernels cannot hash (see the module doc)."""
    return Running(dtype_name, shape, NATIVE) if NATIVE is not None else None
