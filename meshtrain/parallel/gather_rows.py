"""Row gathers whose transpose is a gather too.

The expert exchange moves rows through index maps it knows to be one-to-one (a sort, the slots of a send
buffer) or one-to-k (a token to its k assignments). Written as `x[idx]`, each of them differentiates into
a scatter-add, because autodiff cannot know that no row is read twice; XLA's GPU scatter is a loop of
atomic adds, and in the MoE step on an H100 those scatters took more time than the expert GEMMs. With the
inverse map at hand the transpose is a gather (and, for fan-out, a sum over the k copies):

    forward    y[i] = x[src[i] // k]                    (src[i] past the end: y[i] = 0)
    transpose  dx[j] = Σ_c dy[inverse[j·k + c]]          (inverse past the end of y: that copy adds 0)

`inverse` must be exact: inverse[q] = i for every i with src[i] = q < len(x)·k, and out of range for every
q that no row reads. Nothing checks it at run time; the MoE tests compare gradients with plain indexing.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_rows(x_md: jax.Array, src_n: jax.Array, inverse_q: jax.Array, fan_out: int = 1) -> jax.Array:
    """y [N, ...] with y[i] = x[src[i] // fan_out] (0 where src[i] // fan_out >= M); inverse [M·fan_out]."""
    return jnp.take(x_md, src_n // fan_out, axis=0, mode="fill", fill_value=0)


def _forward(x_md, src_n, inverse_q, fan_out):
    return gather_rows(x_md, src_n, inverse_q, fan_out), (inverse_q, x_md.shape[0])


def _transpose(fan_out, residuals, dy_nd):
    inverse_q, m = residuals
    dx_qd = jnp.take(dy_nd, inverse_q, axis=0, mode="fill", fill_value=0)
    if fan_out > 1:  # the k copies of a row summed in fp32 (a bf16 running sum would round k times)
        dx_qd = dx_qd.reshape(m, fan_out, *dy_nd.shape[1:]).astype(jnp.float32).sum(axis=1).astype(dy_nd.dtype)
    return dx_qd, None, None


gather_rows.defvjp(_forward, _transpose)
