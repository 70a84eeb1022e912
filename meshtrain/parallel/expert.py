"""Expert dispatch: every token's rows go to its experts' devices, through the experts, and back.

Manual over the token axes (the batch's dp, fsdp and ep, and the sequence's cp and sp), automatic over
the rest (tp splits each expert's hidden width, as in a dense FFN). The dispatch has to own every axis
the tokens are split over: each device sorts and sends only its own tokens (a sequence shard's, under
cp/sp), where an automatic axis would gather the tokens of its group and repeat the whole exchange on
every member. The router's statistics (aux losses) are taken outside, over all tokens, so they do not
depend on the split. The collectives run over ep only. Experts are laid out by rank: ep rank r holds
experts [r·X/ep, (r+1)·X/ep).

Dropless (capacity_factor 0), ep = 2, experts e0 e1 on rank 0 and e2 e3 on rank 1, top-2, two ways
(`moe.dispatch`; `auto` is allgather):

    rank 0: a→e0,e2  b→e1,e3  c→e0,e3           rank 1: d→e1,e3  e→e2,e0  f→e2,e3

  allgather (tokens in, partial outputs out; Megatron's allgather dispatcher)
 1  all_gather over ep of the tokens, their experts and weights: both ranks hold a b c d e f
 2  the ep·N·k assignments sorted with mine first, by local expert:
    rank 0: e0 [a c e] e1 [b d] | the rest      rank 1: e2 [a e f] e3 [b c d f] | the rest
 3  the grouped GEMMs over my groups (the rest past their end: the kernel writes zeros there)
 4  unsorted, combined over my experts only: partial y[t] for all six tokens
 5  psum_scatter over ep: each token's partials summed, each rank given back its own tokens

  padded (all-to-all)
 1  its N·k assignments sorted by expert (stable argsort; xY = token x for expert eY):
    [a0 c0 b1 | a2 b3 c3]                       [e0 d1 | e2 f2 d3 f3]
 2  counts per (destination rank, local expert), all_to_all of an int32 [ep, X/ep]
 3  the rows to their experts' ranks in an [ep, N·k, D] buffer, one slot row per possible row
    (ep = 1: nothing moves): rank 0 receives [a0 c0 b1 | e0 d1], rank 1 [a2 b3 c3 | e2 f2 d3 f3]
 4  received rows regrouped by local expert (argsort): e0 [a c e] e1 [b d] | e2 [a e f] e3 [b c d f];
    the grouped GEMMs
 5  results back by the reverse all_to_all, unsorted, combined: y[t] = Σ_j weight[t, j] · out[t, j]

Bytes per rank, in units of (ep - 1)·N·D·bytes(dtype): allgather 2 (tokens in, partial outputs out), padded 2·k.
(A ragged all-to-all would move 2·k/ep, but XLA's GPU ragged all-to-all ran 10x slower than the padded one
with ep = 2 and its gradients disagreed with the padded exchange's, so it is not offered.)
The SwiGLU is three grouped matmuls, the rows of local expert x times W[x] (`moe.grouped_matmul`:
jax.lax.ragged_dot, or the gmm kernel of pallas_kernels; XLA lowers ragged_dot on GPUs to a dense dot over all
local experts, X/ep times the FLOPs and an [X/ep, rows, D] buffer). Every row movement is a
`gather_rows` with its inverse map, so the backward pass gathers too instead of scatter-adding.

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
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from meshtrain.parallel.gather_rows import gather_rows
from meshtrain.precision import Precision
from meshtrain.sharding import ShardingRules, only_axes

# The expert weights' logical names (model/moe.py declares its parameters with them): whole experts
# over ep, each expert's hidden width over tp as in a dense FFN.
W_IN = ("experts", "embed", "mlp")  # w_gate, w_up [X, D, F]
W_OUT = ("experts", "down_mlp", "down_embed")  # w_down [X, F, D]


# The tokens as the block holds them [B, T, ...]: the batch over dp/fsdp/ep, the sequence over cp/sp.
TOKENS = ("batch", "act_seq")


def token_axes(rules: ShardingRules) -> tuple[str, ...]:
    """The mesh axes the tokens are split over (batch and sequence)."""
    return tuple(a for part in rules.spec(TOKENS) if part is not None
                 for a in ((part,) if isinstance(part, str) else part))


def moe_ffn(x_btd: jax.Array, experts_btk: jax.Array, weights_btk: jax.Array, w_gate_xdf: jax.Array,
            w_up_xdf: jax.Array, w_down_xfd: jax.Array, *, rules: ShardingRules, policy: Precision,
            capacity_factor: float, exchange: str, grouped_matmul: str = "ragged_dot", compute_fp32: bool = False
            ) -> tuple[jax.Array, jax.Array]:
    """Routed experts' SwiGLU, combined with the router weights: (y [B, T, D], kept [B, T, K] fp32).
    exchange: allgather or padded (the dropless exchange over ep); grouped_matmul: ragged_dot or pallas;
    compute_fp32: run the region in fp32 whatever the policy (Execution.moe_fp32)."""
    axes = token_axes(rules)
    ep = rules.mesh.shape["ep"]
    n_experts = w_gate_xdf.shape[0]
    # Partial specs, only the manual axes may be named: tokens as the batch, expert weights by expert alone.
    tokens, weights = rules.spec(TOKENS), only_axes(rules.spec(("experts",)), set(axes))
    out_dtype = x_btd.dtype
    if compute_fp32 and not policy.is_fp32:
        # XLA:CPU (jax 0.10) aborts compiling the bf16 version of this region on more than one device
        # ("Invalid binary instruction opcode copy"); CPUs run it in fp32 (they are for tests, not speed).
        policy, x_btd = Precision(policy.param_dtype, jnp.float32), x_btd.astype(jnp.float32)
    local = partial(_local_moe, ep=ep, n_experts=n_experts, policy=policy, capacity_factor=capacity_factor,
                    exchange=exchange if ep > 1 else "local", gemm=grouped_matmul,
                    tp_specs=_tp_specs(rules) if grouped_matmul == "pallas" else None)
    # check_vma off for the kernel: its outputs (a jax-triton call, a host callback) carry no replication type.
    region = jax.shard_map(local, mesh=rules.mesh, axis_names=set(axes),
                           in_specs=(tokens, tokens, tokens, weights, weights, weights),
                           out_specs=(tokens, tokens), check_vma=grouped_matmul != "pallas")
    y_btd, kept_btk = region(x_btd, experts_btk, weights_btk, w_gate_xdf, w_up_xdf, w_down_xfd)
    return y_btd.astype(out_dtype), kept_btk


def _local_moe(x_btd, experts_btk, weights_btk, w_gate_xdf, w_up_xdf, w_down_xfd, *, ep, n_experts, policy,
               capacity_factor, exchange, gemm, tp_specs):
    b, t, d = x_btd.shape
    k = experts_btk.shape[-1]
    x_nd, e_nk, w_nk = x_btd.reshape(b * t, d), experts_btk.reshape(b * t, k), weights_btk.reshape(b * t, k)
    args = dict(w_gate_xdf=w_gate_xdf, w_up_xdf=w_up_xdf, w_down_xfd=w_down_xfd, policy=policy, gemm=gemm)
    ffn = partial(_swiglu, **args) if tp_specs is None else partial(_swiglu_tp, w_specs=tp_specs, **args)
    if capacity_factor > 0:
        out_nkd, kept_nk = _capacity(x_nd, e_nk, ffn, ep=ep, n_experts=n_experts, capacity_factor=capacity_factor)
        y_nd = _combine(w_nk * kept_nk, out_nkd)
    elif exchange == "allgather":
        y_nd, kept_nk = _allgather(x_nd, e_nk, w_nk, ffn, ep=ep, n_experts=n_experts), jnp.ones_like(w_nk)
    else:
        y_nd = _combine(w_nk, _dropless(x_nd, e_nk, ffn, ep=ep, n_experts=n_experts, exchange=exchange))
        kept_nk = jnp.ones_like(w_nk)
    return y_nd.astype(x_btd.dtype).reshape(b, t, d), kept_nk.reshape(b, t, k)


def _combine(w_nk, out_nkd):
    """y[t] = Σ_j w[t, j] · out[t, j], in fp32."""
    return jnp.einsum("nk,nkd->nd", w_nk, out_nkd.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _swiglu(rows_rd, group_sizes_x, *, w_gate_xdf, w_up_xdf, w_down_xfd, policy: Precision, gemm: str):
    """Rows grouped by local expert (group_sizes_x rows each, zero rows after them) -> expert outputs.
    Each GEMM is a named site of the precision policy (config.MATMUL_SITES)."""
    dot = partial(policy.ragged_dot, group_sizes_g=group_sizes_x, kernel=pk.gmm if gemm == "pallas" else None)
    gate_rf = checkpoint_name(dot(rows_rd, w_gate_xdf, site="moe.w_gate"), "moe_hidden")
    up_rf = checkpoint_name(dot(rows_rd, w_up_xdf, site="moe.w_up"), "moe_hidden")
    return checkpoint_name(dot(jax.nn.silu(gate_rf) * up_rf, w_down_xfd, site="moe.w_down"), "moe_out")


def _tp_specs(rules: ShardingRules) -> tuple:
    """The expert weights split over tp alone (gate, up, down), for _swiglu_tp's region."""
    return tuple(only_axes(rules.spec(names), {"tp"}) for names in (W_IN, W_IN, W_OUT))


def _swiglu_tp(rows_rd, group_sizes_x, *, w_specs, w_gate_xdf, w_up_xdf, w_down_xfd, **kw):
    """_swiglu for the kernel. The kernel has no partitioning rule (GSPMD would gather every expert's
    full width onto each tp rank), so this goes manual over tp as well, Megatron style: rank j runs
    columns j·F/tp.. of gate/up and the same rows of down on all its rows; the partial outputs are
    summed over tp. It is manual over every other axis still automatic too (pp outside a pipeline,
    whatever size): a host callback, which runs the kernel in Triton's interpreter on the CPU, is
    allowed only where every mesh axis is manual."""
    def local(rows_rd, sizes_x, wg, wu, wd):
        out_rd = _swiglu(rows_rd, sizes_x, w_gate_xdf=wg, w_up_xdf=wu, w_down_xfd=wd, **kw)
        return jax.lax.psum(out_rd, "tp")

    # The context's mesh: inside the token-manual region it is the one with those axes already manual.
    mesh = jax.sharding.get_abstract_mesh()
    rest = {a for a in mesh.axis_names if a not in mesh.manual_axes}
    return jax.shard_map(local, mesh=mesh, axis_names=rest,
                         in_specs=(P(), P(), *w_specs), out_specs=P(),
                         check_vma=False)(rows_rd, group_sizes_x, w_gate_xdf, w_up_xdf, w_down_xfd)


def _exclusive_cumsum(x):
    return jnp.cumsum(x) - x


# ------------------------------------------------------------------------------------------ dropless


def _dropless(x_nd, e_nk, ffn, *, ep, n_experts, exchange):
    """The experts' outputs [N, K, D] of every assignment, through the padded all-to-all (or locally)."""
    n, k = e_nk.shape
    a = n * k
    per_rank = n_experts // ep
    e_a = e_nk.reshape(a)  # assignment i = token i // k, choice i % k
    order_a = jnp.argsort(e_a, stable=True)  # sorted by expert, hence by destination rank
    inverse_a = jnp.argsort(order_a)
    counts_rl = jnp.bincount(e_a, length=n_experts).astype(jnp.int32).reshape(ep, per_rank)
    send_r = counts_rl.sum(axis=1)

    if exchange == "local":
        x_nd = checkpoint_name(x_nd, "moe_in")
        out_ad = ffn(gather_rows(x_nd, order_a, inverse_a, k), counts_rl[0])
        return gather_rows(out_ad, inverse_a, order_a, 1).reshape(n, k, -1)

    # 2: what each source sends to me, per local expert.
    recv_sl = jax.lax.all_to_all(counts_rl, "ep", 0, 0, tiled=True)
    # 3: sorted row i goes to slot (rank, i - first row for that rank) of an [ep, a] buffer.
    rank_a = e_a[order_a] // per_rank
    slot_of_sorted_a = rank_a * a + jnp.arange(a) - _exclusive_cumsum(send_r)[rank_a]
    slot_a = slot_of_sorted_a[inverse_a]  # assignment i's slot
    filled_by = jnp.full((ep * a,), a, jnp.int32).at[slot_a].set(jnp.arange(a, dtype=jnp.int32),
                                                                 unique_indices=True)  # a: an empty slot
    send_rd = gather_rows(x_nd, filled_by, slot_a, k)
    buf_rd = checkpoint_name(_to_ranks(send_rd.reshape(ep, a, -1), ep).reshape(ep * a, -1), "moe_in")
    out_rd = _local_experts(buf_rd, recv_sl, jnp.arange(ep, dtype=jnp.int32) * a, ffn)
    back_rd = _to_ranks(out_rd.reshape(ep, a, -1), ep).reshape(ep * a, -1)
    return gather_rows(back_rd, slot_a, filled_by, 1).reshape(n, k, -1)


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
    inverse_r = jnp.argsort(perm_r)
    out_rd = ffn(gather_rows(buf_rd, perm_r, inverse_r, 1), recv_sl.sum(axis=0))
    return gather_rows(out_rd, inverse_r, perm_r, 1)


# ------------------------------------------------------------------------------------------ all-gather


def _allgather(x_nd, e_nk, w_nk, ffn, *, ep, n_experts):
    """Dropless by all-gather (Megatron's allgather dispatcher): every rank gathers the tokens of its ep
    group, runs its own experts on the assignments that chose them, combines, and a reduce-scatter sums
    each token's partial outputs over the ranks and hands every rank back its own tokens -> y [N, D].

    Per rank it moves (ep - 1)·N·D rows in and as many out, where the padded all-to-all moves K·N·D to every
    peer and back. The partial outputs are reduced in the compute dtype (in bf16 one more rounding of a sum
    of ep terms, as in Megatron's tensor-parallel reduce-scatter; in fp32 it took 1.6x as long on H100s). The local buffer holds all ep·N·K assignments, those of other ranks' experts sorted past the
    end of the groups, where the grouped GEMM writes zeros."""
    n, k = e_nk.shape
    per_rank = n_experts // ep
    x_md = checkpoint_name(jax.lax.all_gather(x_nd, "ep", tiled=True), "moe_in")  # m = ep·n, rank by rank
    e_mk = jax.lax.all_gather(e_nk, "ep", tiled=True)
    w_mk = jax.lax.all_gather(w_nk, "ep", tiled=True)
    local_b = e_mk.reshape(-1) - jax.lax.axis_index("ep") * per_rank  # b = m·k assignments
    mine_b = (local_b >= 0) & (local_b < per_rank)
    key_b = jnp.where(mine_b, local_b, per_rank)  # other ranks' experts sort last
    order_b = jnp.argsort(key_b, stable=True)
    inverse_b = jnp.argsort(order_b)
    sizes_l = jnp.bincount(key_b, length=per_rank + 1)[:per_rank].astype(jnp.int32)
    out_bd = ffn(gather_rows(x_md, order_b, inverse_b, k), sizes_l)
    out_mkd = gather_rows(out_bd, inverse_b, order_b, 1).reshape(ep * n, k, -1)
    y_md = _combine(jnp.where(mine_b.reshape(ep * n, k), w_mk, 0.0), out_mkd).astype(x_nd.dtype)
    return jax.lax.psum_scatter(y_md, "ep", scatter_dimension=0, tiled=True)


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
    slot_a = jnp.where(kept_kn, e_kn * c + pos_kn, n_experts * c).T.reshape(n * k)  # X·c: nowhere
    filled_by = jnp.full((n_experts * c,), n * k, jnp.int32).at[slot_a].set(jnp.arange(n * k, dtype=jnp.int32),
                                                                            mode="drop")  # n·k: an empty slot
    send_xcd = gather_rows(x_nd, filled_by, slot_a, k).reshape(n_experts, c, -1)
    recv_sxcd = _to_ranks(send_xcd.reshape(ep, per_rank, c, -1), ep)  # [source, local expert, slot, D]
    rows_rd = checkpoint_name(jnp.swapaxes(recv_sxcd, 0, 1).reshape(per_rank * ep * c, -1), "moe_in")  # by expert
    out_rd = ffn(rows_rd, jnp.full((per_rank,), ep * c, jnp.int32))
    out_sxcd = jnp.swapaxes(out_rd.reshape(per_rank, ep, c, -1), 0, 1)
    back_xcd = _to_ranks(out_sxcd, ep).reshape(n_experts * c, -1)
    out_nkd = gather_rows(back_xcd, slot_a, filled_by, 1).reshape(n, k, -1)  # a dropped assignment reads 0
    return out_nkd, kept_kn.T.astype(jnp.float32)


def _to_ranks(x_r, ep):
    """Chunk r of the leading axis to rank r; the result's leading axis is the source rank."""
    if ep == 1:
        return x_r
    return jax.lax.all_to_all(x_r, "ep", 0, 0, tiled=True)
