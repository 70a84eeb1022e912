"""Sampling with a KV cache, sharded like training: batch over (dp, fsdp), heads over tp.

    prompts (token ids, any lengths) -> left-padded [B, P] (B rounded up to the batch shards)
    prefill: one call over [B, P] fills every layer's cache and gives the first new token
    decode:  N-1 one-token calls inside a lax.fori_loop (no host round trip per token)

Padding gets a segment id of its own, so no real token ever attends to it, and every row's positions
start at 0 at its first real token: a short prompt behaves exactly as if it were alone. Temperature 0
is greedy (argmax); otherwise tokens are drawn from softmax(logits / temperature), optionally from the
top_k logits only. The random key of token i is fold_in(seed key, i): runs are reproducible.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.inference import logits
from meshtrain.model.kv_cache import EMPTY, cache_shardings
from meshtrain.model.transformer import Decoder
from meshtrain.sharding import replicated
from meshtrain.train_step import Setup

PAD_SEGMENT = -2  # left padding: a segment no real token belongs to (EMPTY marks unwritten cache slots)


def decoding_model(setup: Setup) -> Decoder:
    m = setup.model
    return Decoder(m.cfg, m.policy, m.rules, m.vocab_padded, decode=True, moe=m.moe, parallel=m.parallel)


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
             top_k: int = 0, seed: int = 0) -> list[list[int]]:
    """New token ids for every prompt (max_new_tokens each)."""
    if max_new_tokens < 1:
        return [[] for _ in prompts]
    mesh, rules = setup.mesh, setup.layout.params
    tokens_bp, positions_bp, segments_bp = layout_prompts(prompts, mesh.shape["dp"] * mesh.shape["fsdp"])
    b, p = tokens_bp.shape
    model = decoding_model(setup)

    # The cache, created directly in its sharding: zeros, segment ids EMPTY, write index 0.
    dummy = jax.ShapeDtypeStruct((b, p + max_new_tokens), jnp.int32)
    shapes = jax.eval_shape(lambda t: model.init(jax.random.key(0), t, t, t), dummy)["cache"]
    cache_sh = cache_shardings(shapes, rules)

    def empty_cache():
        fill = lambda path, s: jnp.full(s.shape, EMPTY if path[-1].key == "seg" else 0, s.dtype)  # noqa: E731
        return jax.tree_util.tree_map_with_path(fill, shapes)

    cache = jax.jit(empty_cache, out_shardings=cache_sh)()
    token_sh = rules.sharding(("batch", None))

    def run(params, cache, tokens_bp, positions_bp, segments_bp, key):
        def step(cache, tokens_bt, positions_bt, segments_bt):
            (h_btd, head_dv), new = model.apply({"params": params, "cache": cache}, tokens_bt, positions_bt,
                                                segments_bt, mutable=["cache"])
            return new["cache"], logits(setup, h_btd[:, -1:], head_dv)[:, 0]

        cache, logits_bv = step(cache, tokens_bp, positions_bp, segments_bp)
        first_b = sample(logits_bv, jax.random.fold_in(key, 0), temperature, top_k)
        out_bn = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first_b)
        zeros_b1 = jnp.zeros((b, 1), jnp.int32)

        def body(i, carry):
            cache, out_bn, token_b, position_b = carry
            cache, logits_bv = step(cache, token_b[:, None], position_b[:, None], zeros_b1)
            token_b = sample(logits_bv, jax.random.fold_in(key, i), temperature, top_k)
            return cache, out_bn.at[:, i].set(token_b), token_b, position_b + 1

        next_position_b = positions_bp[:, -1] + 1
        _, out_bn, _, _ = jax.lax.fori_loop(1, max_new_tokens, body, (cache, out_bn, first_b, next_position_b))
        return out_bn

    run_jit = jax.jit(run, in_shardings=(setup.state_shardings.params, cache_sh, token_sh, token_sh, token_sh,
                                         replicated(mesh)), out_shardings=replicated(mesh))
    out_bn = run_jit(params, cache, tokens_bp, positions_bp, segments_bp, jax.random.key(seed))
    return np.asarray(out_bn)[: len(prompts)].tolist()
