"""Does jax-triton run a Triton kernel with this machine's jax and triton? Prints the versions and
checks one element-wise Triton kernel called through `jax_triton.triton_call`, eagerly and under jit.

  pip install --no-deps --target /tmp/jt jax_triton-*.whl   # e.g. a wheel carried to an offline GPU machine
  PYTHONPATH=/tmp/jt python3 scripts/probe_jax_triton.py

Exit status 0 when both results are right. (pallas_kernels' Triton flash attention goes through
jax-triton the same way; docs/KERNELS_NOTES.md, "The Triton fallback on jax-triton".)
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp


def main() -> int:
    import triton
    import triton.language as tl
    import jax_triton as jt

    print(f"jax {jax.__version__}, triton {triton.__version__}, jax_triton {getattr(jt, '__version__', '?')}, "
          f"device {jax.devices()[0].device_kind}")

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n: tl.constexpr, block: tl.constexpr):
        offs = tl.program_id(0) * block + tl.arange(0, block)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside)
        y = tl.load(y_ptr + offs, mask=inside)
        tl.store(out_ptr + offs, x + y, mask=inside)

    n, block = 1000, 256
    x = jnp.arange(n, dtype=jnp.float32)
    y = 2 * x

    def add(a, b):
        return jt.triton_call(a, b, kernel=add_kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
                              grid=(pl_cdiv(n, block),), n=n, block=block)

    eager_ok = bool((add(x, y) == 3 * x).all())
    jit_ok = bool((jax.jit(add)(x, y) == 3 * x).all())
    print(f"triton_call correct: eager {eager_ok}, under jit {jit_ok}")
    return 0 if eager_ok and jit_ok else 1


def pl_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    sys.exit(main())
