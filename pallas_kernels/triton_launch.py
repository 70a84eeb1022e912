"""Runs a kernel written in Triton's language on jax arrays.

On the GPU through jax-triton's `triton_call` (Triton's own compiler, called from XLA as a custom
call). With `interpret=True`, on any backend, through Triton's interpreter on the host: the kernel
runs in a `jax.pure_callback` on numpy copies of its inputs, which is how the CPU tests run it.

The calling convention is jax-triton's for both: the kernel's pointer arguments are the inputs,
then the outputs; everything static is a keyword constexpr. Triton and jax-triton are imported
only when a kernel runs, so the package imports without them (they are the `triton` extra).

Triton's interpreter is a mode of the whole process: `@triton.jit` reads it when a function is
decorated, Triton's own library functions included, so it must be on before `triton.language` is
first imported. The first launch of a process therefore picks the mode, and a launch that needs
the other one says so.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

# The interpreter keeps its grid position in module globals: one launch at a time in a process,
# though XLA may run the callbacks of several CPU devices at once (shard_map tests).
_INTERPRETER_LOCK = threading.Lock()


def launch(module: str, kernel: str, *args, out_shape, grid: tuple[int, ...], num_warps: int, num_stages: int,
           interpret: bool, **constexprs):
    """`module.kernel[grid](*args, *outputs, **constexprs)`; returns the outputs as a list."""
    _import_triton(interpret)
    fn = getattr(importlib.import_module(module), kernel)
    out_shape = list(out_shape)
    if interpret:
        return _interpreted_call(fn, args, out_shape, grid, constexprs)
    outs = _jax_triton().triton_call(*args, kernel=fn, out_shape=out_shape, grid=grid, name=kernel,
                                     num_warps=num_warps, num_stages=num_stages, **constexprs)
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _import_triton(interpret: bool) -> None:
    """Imports triton in the mode this launch needs (see the module docstring), or says why it cannot."""
    if interpret and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    except ImportError as e:
        raise ImportError("meshtrain's Triton kernels need the `triton` package (pip install -e '.[triton]' on a "
                          "GPU, -e '.[test]' for the interpreter)") from e
    if not hasattr(triton, "knobs"):
        raise ImportError(f"meshtrain's Triton kernels need triton >= 3.6 (jax-triton's floor); this is "
                          f"{triton.__version__}")
    if bool(triton.knobs.runtime.interpret) != interpret:
        if interpret:
            raise RuntimeError("interpret=True runs Triton's interpreter, but this process imported triton "
                               "with it off; start the process with TRITON_INTERPRET=1")
        raise RuntimeError("Triton's interpreter is on in this process (TRITON_INTERPRET=1, or an earlier "
                           "interpret=True launch), so its kernels cannot be compiled for the GPU; unset "
                           "TRITON_INTERPRET, or pass interpret=True")


def _jax_triton():
    try:
        import jax_triton
    except ImportError as e:
        raise ImportError(
            "meshtrain's Triton kernels need jax-triton on the GPU (pip install -e '.[triton]'); "
            f"importing it failed: {e}") from e
    return jax_triton


def _interpreted_call(fn, args, out_shape, grid, constexprs):
    def on_host(*arrays):
        outs = [np.zeros(o.shape, _interpretable(o.dtype)) for o in out_shape]
        ins = [np.ascontiguousarray(a, _interpretable(a.dtype)) for a in arrays]
        with _INTERPRETER_LOCK:
            fn[grid](*map(_HostTensor, ins), *map(_HostTensor, outs), **constexprs)
        return [o.astype(s.dtype) for o, s in zip(outs, out_shape)]

    return list(jax.pure_callback(on_host, out_shape, *args, vmap_method="sequential"))


def _interpretable(dtype) -> np.dtype:
    """The dtype an array crosses into the interpreter as. Triton's interpreter keeps bfloat16 as its raw
    16 bits and its tl.dot multiplies those as integers (triton 3.9), so bfloat16 goes in as float32
    (and outputs come back rounded): interpreted, a bfloat16 kernel computes in float32."""
    return np.dtype(np.float32) if dtype == jnp.bfloat16 else np.dtype(dtype)


class _HostTensor:
    """The part of a torch tensor's interface Triton's interpreter reads, over a numpy array: its
    address, dtype and layout. The interpreter's host "copies" are views of the same memory, so its
    copy back is a no-op."""

    def __init__(self, array: np.ndarray | None):
        self.array = array

    @property
    def dtype(self):
        return self.array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> "_HostTensor":
        return self

    def cpu(self) -> "_HostTensor":
        return self

    def new_empty(self, *_, **__) -> "_HostTensor":
        return _HostTensor(None)

    def set_(self, storage: "_HostTensor", *_):
        self.array = storage.array

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def copy_(self, other: "_HostTensor"):
        assert other.data_ptr() == self.data_ptr(), "the interpreter's host copy is a view of the same memory"
