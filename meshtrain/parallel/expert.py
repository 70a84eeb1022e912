"""Expert dispatch: every token's rows go to its experts' devices, through the experts, and back.

Manual over the token axes (the mesh axes of the `batch` rule: dp, fsdp and ep), automatic over the
rest (tp splits each expert's hidden width, as in a dense FFN). The dispatch has to own every axis the
tokens are split over: each device sorts and sends only its own tokens, where an automatic dp/fsdp
would gather the tokens of its group and repeat the whole exchange on every member. The collectives
run over ep only. Experts are laid out by rank: ep rank r holds experts [r·X/ep, (r+1)·X/ep).

Dropless (capacity_factor 0), ep = 2, experts e0 e1 on rank 0 and e2 e3 on rank 1, top-2:

    rank 0: a→e0,e2  b→e1,e3  c→e0,e3           rank 1: d→e1,e3  e→e2,e0  f→e2,e3
 1  its N·k assignments sorted by expert (stable argsort; xY = token x for expert eY):
    [a0 c0 b1 | a2 b3 c3]                       [e0 d1 | e2 f2 d3 f3]
 2  counts per (destination rank, local expert), all_to_all of an int32 [ep, X/ep]
 3  the rows to their experts' ranks:
      ragged   jax.lax.ragged_all_to_all sends exactly the rows (offsets from the counts)
      padded   a [ep, N·k, D] buffer, one slot row per possible row, moved by all_to_all
      local    ep = 1: nothing moves
    rank 0 receives [a0 c0 b1 | e0 d1]          rank 1 receives [a2 b3 c3 | e2 f2 d3 f3]
 4  received rows regrouped by local expert (argsort): e0 [a c e] e1 [b d] | e2 [a e f] e3 [b c d f];
    the SwiGLU as three grouped matmuls, the rows of local expert x times W[x] (`moe.grouped_matmul`:
    jax.lax.ragged_dot, or the Pallas gmm kernel; XLA lowers ragged_dot on GPUs to a dense dot over all
    local experts, X/ep times the FLOPs and an [X/ep, rows, D] buffer)
 5  results back by the reverse exchange, unsorted, combined: y[t] = Σ_j weight[t, j] · out[t, j]

Capacity (GShard, capacity_factor > 0): each (source device, expert) pair has C = ceil(cf·N·k/X) slots,
filled in priority order: every token's first choice, then every second choice, and so on. Overflow is
dropped: its weight counts as 0, so a token whose choices all overflow passes through the residual.
Fixed shapes, no counts to exchange:

    [X, C, D] --all_to_all(split X over ep, stack sources)--> [ep_src, X/ep, C, D] --experts-->
    [ep_src, X/ep, C, D] --all_to_all back--> [X, C, D] --gather each assignment's slot--> combine

With capacity the kept set depends on how many tokens a device holds, so layouts agree only when no
token is dropped; dropless is layout-independent.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from meshtrain.precision import Precision
from meshtrain.sharding import ShardingRules, only_axes

# The expert weights' logical names (model/moe.py declares its parameters with them): whole experts
# over ep, each expert's hidden width over tp as in a dense FFN.
W_IN = ("experts", "embed", "mlp")  # w_gate, w_up [X, D, F]
W_OUT = ("experts", "mlp", "embed")  # w_down [X, F, D]


def token_axes(rules: ShardingRules) -> tuple[str, ...]:
    """The mesh axes the token (batch) dimension is split over."""
    axes = rules.spec(("batch",))[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def moe_ffn(x_btd: jax.Array, experts_btk: jax.Array, weights_btk: jax.Array, w_gate_xdf: jax.Array,
            w_up_xdf: jax.Array, w_down_xfd: jax.Array, *, rules: ShardingRules, policy: Precision,
            capacity_factor: float, exchange: str, grouped_matmul: str = "ragged_dot", compute_fp32: bool = False
            ) -> tuple[jax.Array, jax.Array]:
    """Routed experts' SwiGLU, combined with the router weights: (y [B, T, D], kept [B, T, K] fp32).
    exchange: ragged or padded (the dropless all-to-all over ep); grouped_matmul: ragged_dot or pallas;
    compute_fp32: run the region in fp32 whatever the policy (Execution.moe_fp32)."""
    axes = token_axes(rules)
    ep = rules.mesh.shape["ep"]
    n_experts = w_gate_xdf.shape[0]
    # Partial specs, only the manual axes may be named: tokens as the batch, expert weights by expert alone.
    tokens, weights = rules.spec(("batch",)), only_axes(rules.spec(("experts",)), set(axes))
    out_dtype = x_btd.dtype
    if compute_fp32 and not policy.is_fp32:
        # XLA:CPU (jax 0.10) aborts compiling the bf16 version of this region on more than one device
        # ("Invalid binary instruction opcode copy"); CPUs run it in fp32 (they are for tests, not speed).
        policy, x_btd = Precision(policy.param_dtype, jnp.float32), x_btd.astype(jnp.float32)
    local = partial(_local_moe, ep=ep, n_experts=n_experts, policy=policy, capacity_factor=capacity_factor,
                    exchange=exchange if ep > 1 else "local", gemm=grouped_matmul,
                    tp_specs=_tp_specs(rules) if grouped_matmul == "pallas" and rules.mesh.shape["tp"] > 1 else None)
    # check_vma off for the kernel: a pallas_call's outputs carry no replication type for the checker.
    region = jax.shard_map(local, mesh=rules.mesh, axis_names=set(axes),
                           in_specs=(tokens, tokens, tokens, weights, weights, weights),
                           out_specs=(tokens, tokens), check_vma=grouped_matmul != "pallas")
    y_btd, kept_btk = region(x_btd, experts_btk, weights_btk, w_gate_xdf, w_up_xdf, w_down_xfd)
    return y_btd.astype(out_dtype), kept_btk


def _local_moe(x_btd, experts_btk, weights_btk, w_gate_xdf, w_up_xdf, w_down_xfd, *, ep, n_experts, policy,
               capacity_factor, exchange, gemm, tp_specs):
    b, t, d = x_btd.shape
    k = experts_btk.shape[-1]
    x_nd, e_nk = x_btd.reshape(b * t, d), experts_btk.reshape(b * t, k)
    args = dict(w_gate_xdf=w_gate_xdf, w_up_xdf=w_up_xdf, w_down_xfd=w_down_xfd, policy=policy, gemm=gemm)
    ffn = partial(_swiglu, **args) if tp_specs is None else partial(_swiglu_tp, w_specs=tp_specs, **args)
    if capacity_factor > 0:
        out_nkd, kept_nk = _capacity(x_nd, e_nk, ffn, ep=ep, n_experts=n_experts, capacity_factor=capacity_factor)
    else:
        out_nkd = _dropless(x_nd, e_nk, ffn, ep=ep, n_experts=n_experts, exchange=exchange)
        kept_nk = jnp.ones(e_nk.shape, jnp.float32)
    w_nk = weights_btk.reshape(b * t, k) * kept_nk
    y_nd = jnp.einsum("nk,nkd->nd", w_nk, out_nkd.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return y_nd.astype(x_btd.dtype).reshape(b, t, d), kept_nk.reshape(b, t, k)


def _swiglu(rows_rd, group_sizes_x, *, w_gate_xdf, w_up_xdf, w_down_xfd, policy: Precision, gemm: str):
    """Rows grouped by local expert (group_sizes_x rows each, zero rows after them) -> expert outputs.
    Each GEMM is a named site of the precision policy (config.MATMUL_SITES)."""
    dot = partial(policy.ragged_dot, group_sizes_g=group_sizes_x, kernel=pk.gmm if gemm == "pallas" else None)
    gate_rf = dot(rows_rd, w_gate_xdf, site="moe.w_gate")
    up_rf = dot(rows_rd, w_up_xdf, site="moe.w_up")
    return dot(jax.nn.silu(gate_rf) * up_rf, w_down_xfd, site="moe.w_down")


def _tp_specs(rules: ShardingRules) -> tuple:
    """The expert weights split over tp alone (gate, up, down), for _swiglu_tp's tp-manual region."""
    return tuple(only_axes(rules.spec(names), {"tp"}) for names in (W_IN, W_IN, W_OUT))


def _swiglu_tp(rows_rd, group_sizes_x, *, w_specs, w_gate_xdf, w_up_xdf, w_down_xfd, **kw):
    """_swiglu for the kernel under tp > 1. A pallas_call has no partitioning rule (GSPMD would gather
    every expert's full width onto each tp rank), so this goes manual over tp as well, Megatron style:
    rank j runs columns j·F/tp.. of gate/up and the same rows of down on all its rows; the partial
    outputs are summed over tp."""
    def local(rows_rd, sizes_x, wg, wu, wd):
        out_rd = _swiglu(rows_rd, sizes_x, w_gate_xdf=wg, w_up_xdf=wu, w_down_xfd=wd, **kw)
        return jax.lax.psum(out_rd, "tp")

    # The context's mesh: inside the token-manual region it is the one with those axes already manual.
    return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), axis_names={"tp"},
                         in_specs=(P(), P(), *w_specs), out_specs=P(),
                         check_vma=False)(rows_rd, group_sizes_x, w_gate_xdf, w_up_xdf, w_down_xfd)


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


# ------------------------------------------------------------------------------------------ dropless


def _dropless(x_nd, e_nk, ffn, *, ep, n_experts, exchange):
    n, k = e_nk.shape
    a = n * k
    per_rank = n_experts // ep
    e_a = e_nk.reshape(a)  # assignment i = token i // k, choice i % k
    order_a = jnp.argsort(e_a, stable=True)  # sorted by expert, hence by destination rank
    inverse_a = jnp.argsort(order_a)
    counts_rl = jnp.bincount(e_a, length=n_experts).astype(jnp.int32).reshape(ep, per_rank)
    send_r = counts_rl.sum(axis=1)

    if exchange == "local":
        rows_ad = x_nd[order_a // k]
        out_ad = ffn(rows_ad, counts_rl[0])
        return out_ad[inverse_a].reshape(n, k, -1)

    # 2: what each source sends to me, per local expert.
    recv_sl = jax.lax.all_to_all(counts_rl, "ep", 0, 0, tiled=True)
    recv_s = recv_sl.sum(axis=1)
    if exchange == "ragged":
        sizes_sr = jax.lax.all_gather(send_r, "ep")  # [source, destination] row counts, the same on every rank
        me = jax.lax.axis_index("ep")
        send_offsets_r = _exclusive_cumsum(send_r)
        # Where my chunk lands in each destination's buffer: after the chunks of lower-ranked sources.
        land_offsets_r = _exclusive_cumsum(sizes_sr, axis=0)[me]
        recv_offsets_s = _exclusive_cumsum(recv_s)
        back_offsets_s = _exclusive_cumsum(sizes_sr, axis=1)[:, me]  # my results' place in each source's rows
        rows_ad = x_nd[order_a // k]
        buf_rd = jax.lax.ragged_all_to_all(rows_ad, jnp.zeros((ep * a, x_nd.shape[1]), x_nd.dtype), send_offsets_r,
                                           send_r, land_offsets_r, recv_s, axis_name="ep")
        out_rd = _local_experts(buf_rd, recv_sl, recv_offsets_s, ffn)
        out_ad = jax.lax.ragged_all_to_all(out_rd, jnp.zeros((a, out_rd.shape[1]), out_rd.dtype), recv_offsets_s,
                                           recv_s, back_offsets_s, send_r, axis_name="ep")
        return out_ad[inverse_a].reshape(n, k, -1)

    # padded: sorted row i goes to slot (rank, i - first row for that rank) of an [ep, a] buffer.
    rank_a = e_a[order_a] // per_rank
    slot_a = rank_a * a + jnp.arange(a) - _exclusive_cumsum(send_r)[rank_a]
    filled_by = jnp.full((ep * a,), -1, jnp.int32).at[slot_a].set(order_a.astype(jnp.int32), unique_indices=True)
    send_rd = jnp.where(filled_by[:, None] >= 0, x_nd[jnp.maximum(filled_by, 0) // k], 0)
    buf_rd = _to_ranks(send_rd.reshape(ep, a, -1), ep).reshape(ep * a, -1)
    out_rd = _local_experts(buf_rd, recv_sl, jnp.arange(ep, dtype=jnp.int32) * a, ffn)
    back_rd = _to_ranks(out_rd.reshape(ep, a, -1), ep).reshape(ep * a, -1)
    return back_rd[slot_a][inverse_a].reshape(n, k, -1)


def _local_experts(buf_rd, recv_sl, offsets_s, ffn):
    """A received buffer (source s's rows from offsets_s[s], sorted by local expert, zeros elsewhere)
    -> the experts' outputs in the same places."""
    r = buf_rd.shape[0]
    row_r = jnp.arange(r, dtype=jnp.int32)
    src_r = jnp.sum(row_r[:, None] >= offsets_s[None, :], axis=1) - 1
    within_r = row_r - offsets_s[src_r]
    ends_rl = jnp.cumsum(recv_sl, axis=1)[src_r]  # [R, X/ep] row ends of each local expert in that source
    expert_r = jnp.sum(within_r[:, None] >= ends_rl, axis=1)  # per_rank: past the source's rows (padding)
    perm_r = jnp.argsort(expert_r, stable=True)  # grouped by local expert, padding last
    out_rd = ffn(buf_rd[perm_r], recv_sl.sum(axis=0))
    return out_rd[jnp.argsort(perm_r)]


# ------------------------------------------------------------------------------------------ capacity


def capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per (source device, expert): GShard's ceil(cf · assignments / experts), at least 1."""
    return max(1, math.ceil(capacity_factor * n_tokens * top_k / n_experts))


def _capacity(x_nd, e_nk, ffn, *, ep, n_experts, capacity_factor):
    n, k = e_nk.shape
    c = capacity(n, k, n_experts, capacity_factor)
    per_rank = n_experts // ep
    # Queue position of every assignment at its expert, first choices ahead of second choices (GShard).
    e_kn = e_nk.T
    onehot_knx = jax.nn.one_hot(e_kn, n_experts, dtype=jnp.int32)
    before_knx = jnp.cumsum(onehot_knx.reshape(k * n, n_experts), axis=0).reshape(k, n, n_experts) - onehot_knx
    pos_kn = jnp.sum(before_knx * onehot_knx, axis=-1)
    kept_kn = pos_kn < c
    slot_kn = jnp.where(kept_kn, e_kn * c + pos_kn, n_experts * c)  # n_experts * c: nowhere
    token_kn = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (k, n))
    filled_by = jnp.full((n_experts * c,), -1, jnp.int32).at[slot_kn.reshape(-1)].set(token_kn.reshape(-1),
                                                                                      mode="drop")
    send_xcd = jnp.where(filled_by[:, None] >= 0, x_nd[jnp.maximum(filled_by, 0)], 0).reshape(n_experts, c, -1)
    recv_sxcd = _to_ranks(send_xcd.reshape(ep, per_rank, c, -1), ep)  # [source, local expert, slot, D]
    rows_rd = jnp.swapaxes(recv_sxcd, 0, 1).reshape(per_rank * ep * c, -1)  # grouped by local expert
    out_rd = ffn(rows_rd, jnp.full((per_rank,), ep * c, jnp.int32))
    out_sxcd = jnp.swapaxes(out_rd.reshape(per_rank, ep, c, -1), 0, 1)
    back_xcd = _to_ranks(out_sxcd, ep).reshape(n_experts * c, -1)
    out_knd = jnp.where(kept_kn[..., None], back_xcd[jnp.minimum(slot_kn, n_experts * c - 1)], 0)
    return jnp.swapaxes(out_knd, 0, 1), kept_kn.T.astype(jnp.float32)


def _to_ranks(x_r, ep):
    """Chunk r of the leading axis to rank r; the result's leading axis is the source rank."""
    if ep == 1:
        return x_r
    return jax.lax.all_to_all(x_r, "ep", 0, 0, tiled=True)
