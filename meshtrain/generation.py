"""Sampling with a KV cache, sharded like training: batch over (dp, fsdp), heads over tp.

    prompts (token ids, any lengths) -> left-padded [B, P] (B rounded up to the batch shards)
    prefill: one call over [B, P] fills every layer's cache and gives the first new token
    decode:  one-token steps inside a lax.fori_loop, `chunk` of them per compiled call (one host round
             trip per chunk, not per token): between calls the caller hears how far it got

Padding gets a segment id of its own, so no real token ever attends to it, and every row's positions
start at 0 at its first real token: a short prompt behaves exactly as if it were alone. Temperature 0
is greedy (argmax); otherwise tokens are drawn from softmax(logits / temperature), optionally from the
top_k logits only. The random key of token i is fold_in(seed key, i): runs are reproducible.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.inference import logits
from meshtrain.model.kv_cache import EMPTY, cache_shardings
from meshtrain.model.transformer import Decoder
from meshtrain.sharding import replicated
from meshtrain.step.state import Setup

PAD_SEGMENT = -2  # left padding: a segment no real token belongs to (EMPTY marks unwritten cache slots)
CHUNK = 128  # decode steps per compiled call: progress every ~second on a GPU, at ~1% dispatch cost


def decoding_model(setup: Setup) -> Decoder:
    return setup.model.clone(decode=True, remat="none", document_mask=False)


def layout_prompts(prompts: list[list[int]], batch_shards: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Left-pad to [B, P], B a multiple of `batch_shards` (extra rows are empty prompts):
    tokens, positions (0 at each row's first real token) and segment ids (PAD_SEGMENT on padding)."""
    b = -(-len(prompts) // batch_shards) * batch_shards
    p = max(1, max(len(x) for x in prompts))
    tokens = np.zeros((b, p), np.int32)
    positions = np.zeros((b, p), np.int32)
    segments = np.full((b, p), PAD_SEGMENT, np.int32)
    for r, ids in enumerate(prompts):
        n = len(ids)
        tokens[r, p - n:] = ids
        positions[r, p - n:] = np.arange(n)
        segments[r, p - n:] = 0
    return tokens, positions, segments


def sample(logits_bv: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    scaled_bv = logits_bv / temperature
    if top_k:
        kth_b = jax.lax.top_k(scaled_bv, top_k)[0][:, -1:]
        scaled_bv = jnp.where(scaled_bv < kth_b, -jnp.inf, scaled_bv)
    return jax.random.categorical(key, scaled_bv, axis=-1).astype(jnp.int32)


def generate(setup: Setup, params: Any, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, chunk: int = CHUNK,
             progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """New token ids for every prompt (max_new_tokens each). `progress(n)` hears after each compiled call
    how many new tokens every row has so far. The decode runs in whole chunks (at most chunk - 1 steps
    past max_new_tokens, dropped): one compiled call serves every chunk."""
    if max_new_tokens < 1:
        return [[] for _ in prompts]
    mesh, rules = setup.mesh, setup.layout.params
    # ep is one more batch axis outside the experts (sharding.py), so the rows must split over it too.
    tokens_bp, positions_bp, segments_bp = layout_prompts(prompts, mesh.shape["dp"] * mesh.shape["fsdp"]
                                                          * mesh.shape["ep"])
    b, p = tokens_bp.shape
    chunk = max(1, min(chunk, max_new_tokens - 1))
    n_chunks = -(-(max_new_tokens - 1) // chunk)
    n_new = 1 + n_chunks * chunk  # the prefill's token, then whole chunks
    model = decoding_model(setup)

    # The cache, created directly in its sharding: zeros, segment ids EMPTY, write index 0.
    dummy = jax.ShapeDtypeStruct((b, p + n_new), jnp.int32)
    shapes = jax.eval_shape(lambda t: model.init(jax.random.key(0), t, t, t), dummy)["cache"]
    cache_sh = cache_shardings(shapes, rules)

    def empty_cache():
        fill = lambda path, s: jnp.full(s.shape, EMPTY if path[-1].key == "seg" else 0, s.dtype)  # noqa: E731
        return jax.tree_util.tree_map_with_path(fill, shapes)

    def step(params, cache, tokens_bt, positions_bt, segments_bt):
        (h_btd, head_dv), new = model.apply({"params": params, "cache": cache}, tokens_bt, positions_bt,
                                            segments_bt, mutable=["cache"])
        return new["cache"], logits(setup, h_btd[:, -1:], head_dv)[:, 0]

    def prefill(params, cache, tokens_bp, positions_bp, segments_bp, key):
        cache, logits_bv = step(params, cache, tokens_bp, positions_bp, segments_bp)
        first_b = sample(logits_bv, jax.random.fold_in(key, 0), temperature, top_k)
        out_bn = jnp.zeros((b, n_new), jnp.int32).at[:, 0].set(first_b)
        return cache, out_bn, first_b, positions_bp[:, -1] + 1

    def decode(params, cache, out_bn, token_b, position_b, key, start):
        zeros_b1 = jnp.zeros((b, 1), jnp.int32)

        def body(i, carry):
            cache, out_bn, token_b, position_b = carry
            cache, logits_bv = step(params, cache, token_b[:, None], position_b[:, None], zeros_b1)
            token_b = sample(logits_bv, jax.random.fold_in(key, i), temperature, top_k)
            return cache, out_bn.at[:, i].set(token_b), token_b, position_b + 1

        return jax.lax.fori_loop(start, start + chunk, body, (cache, out_bn, token_b, position_b))

    token_sh, key_sh = rules.sharding(("batch", None)), replicated(mesh)
    row_sh = rules.sharding(("batch",))
    carry_sh = (cache_sh, token_sh, row_sh, row_sh)
    prefill_jit = jax.jit(prefill, in_shardings=(setup.state_shardings.params, cache_sh, token_sh, token_sh, token_sh,
                                                 key_sh), out_shardings=carry_sh, donate_argnums=1)
    decode_jit = jax.jit(decode, in_shardings=(setup.state_shardings.params, *carry_sh, key_sh, None),
                         out_shardings=carry_sh, donate_argnums=(1, 2, 3, 4))
    key = jax.random.key(seed)
    cache = jax.jit(empty_cache, out_shardings=cache_sh)()
    carry = prefill_jit(params, cache, tokens_bp, positions_bp, segments_bp, key)
    for c in range(n_chunks):
        carry = decode_jit(params, *carry, key, 1 + c * chunk)
        if progress is not None:
            carry[2].block_until_ready()  # the chunk's last tokens: one small wait per chunk
            progress(min(max_new_tokens, 1 + (c + 1) * chunk))
    return np.asarray(jax.device_get(carry[1]))[: len(prompts), :max_new_tokens].tolist()
