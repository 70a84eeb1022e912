"""The ops a pipeline stage runs on one chunk (k consecutive layers) for one microbatch.

Pure per-device functions, no collective over pp: the executor (executor.py) calls them inside
its manual region, the benchmark (scripts/bench_pipeline.py) times them alone. A chunk's
position decides what else it runs: the first chunk embeds the tokens, the last computes final
norm, head and loss; a middle one reads the previous chunk's output.

    F  x ─ chunk ─> y, and the chunk's pullback kept        (first: tokens ─ embed ─ chunk)
    B  dy, the kept pullback ─> dx (+ dW when the backward is not split)
    W  dy, the kept pullback ─> dW                           (split backward only)
    the last chunk: F does nothing; B runs chunk, head, loss and the whole backward from its x

MoE layers sow auxiliary losses and router metrics (model/moe.py). A chunk's output is then the pair
(y, aux): aux the sum of its sown losses, which enters the objective as n·aux (step/loss.py: n labelled
tokens of the microbatch), so its cotangent at B is scale·n beside dy. F reports n·aux as its share of the
loss sum and n·(its layers' sum) of every metric; the executor divides the metric sums by the number of
layers that sow them, as the step without the pipeline takes their mean over layers.

What F keeps is the chunk's jax.vjp pullback (its residuals: what the model's remat policy,
train.remat, saves of each layer), in the stage's stash (`Stash`); B spends it, as a step without
the pipeline spends its residuals, so B costs a backward, not a forward and a backward. The last
chunk keeps nothing: its forward and backward run back to back (B follows F on that stage at once in
every schedule), which spares the stash its logits.

The ops take a chunk's layer params as the stage holds them for the whole step: the weights of bf16
matmul sites already cast to the compute dtype (`cast_sites`, once per step in the executor; a site casts
them anyway, and casting a stage's weights at every op took about 1.2 ms per op for a 1B model's half on an
H100). The gradients come back in that dtype and are accumulated in fp32. The pullback's residuals include
those weights (a matmul's input gradient needs them); they are not kept per microbatch: the pullback holds
the very arrays the stage reads again at B, and the stash stores only the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.struct
import jax

from meshtrain.config import MATMUL_SITES
from meshtrain.data import Batch
from meshtrain.model.loss import label_count
from meshtrain.model.moe import LOSSES, METRICS
from meshtrain.model.layers import FP8_META
from meshtrain.model.transformer import RESIDUAL, Decoder, seq_info
from meshtrain.precision import Precision
from meshtrain.step.loss import aux_loss, cross_entropy, objective, sown_sums
from meshtrain.step.pipeline.ticks import B, F, FIRST, LAST, MID, W


@flax.struct.dataclass
class OpOut:
    """What an op yields; None where it yields nothing (a pytree, so an op can be jitted alone)."""

    d_layers: Any = None  # gradient of the chunk's layer params
    d_shared: Any = None  # gradient of embedding / final_norm / lm_head (first and last chunks)
    message: jax.Array | None = None  # y (F) or dx (B), for the neighbouring chunk
    loss: jax.Array | None = None  # its share of the objective's sum: n·aux (F), the rest (the last chunk's B)
    count: jax.Array | None = None  # labelled tokens, the cross-entropy sum, n·metric sums (the last chunk's B)
    ce: jax.Array | None = None
    metrics: dict | None = None  # also from F: n·(the chunk's sum of each sown metric)
    kept: list | None = None  # F of a chunk before the last: its pullback's leaves for the stash
    meta: Any = None  # fp8_delayed: the chunk's amax histories with this microbatch's amaxes pushed (one op per
    # microbatch reports them: the one that runs the pullback for the input gradient, or for the first chunk's W)


# (layer params, shared params, x, dy, microbatch, scale, the stash's leaves for this op, the chunk's fp8
# histories or {}) -> OpOut
OpFn = Callable[[Any, Any, jax.Array, jax.Array, Batch, jax.Array, list, Any], OpOut]



def cast_sites(policy: Precision, layers: Any) -> Any:
    """A chunk's layer params with the weights of bf16 matmul sites (`attn/wq` is site `attn.wq`) in the
    compute dtype, as the site would cast them; the rest (norm scales, fp8 sites' fp32 masters) as they are."""
    def one(path, a):
        site = ".".join(str(k.key) for k in path[-2:] if isinstance(k, jax.tree_util.DictKey))
        return policy.cast(a) if site in MATMUL_SITES and policy.recipe(site) == "bf16" else a

    return jax.tree_util.tree_map_with_path(one, layers)


@dataclass(frozen=True)
class Stash:
    """What F keeps of a chunk's pullback: its leaves less those that are the chunk's (cast) weights.

    `treedef` and `weight_of` come from one abstract trace of the chunk (`Stash.of`); every chunk
    before the last has k layers and so the same pullback structure."""

    treedef: Any
    weight_of: tuple[int, ...]  # per pullback leaf: the index of the weight leaf it is, or -1 (kept)
    kept: tuple[jax.ShapeDtypeStruct, ...]  # the leaves kept per microbatch

    @classmethod
    def of(cls, vjp_chunk: Callable, layers: Any, x_btd: Any, mb: Any, meta: Any) -> "Stash":
        box = {}

        def trace(layers, x_btd, mb, meta):
            leaves, box["treedef"] = jax.tree.flatten(vjp_chunk(layers, x_btd, mb, meta)[1])
            weights = jax.tree.leaves(layers)
            box["weight_of"] = tuple(next((i for i, w in enumerate(weights) if w is leaf), -1) for leaf in leaves)
            return [leaf for leaf, w in zip(leaves, box["weight_of"]) if w < 0]

        kept = jax.eval_shape(trace, layers, x_btd, mb, meta)
        return cls(box["treedef"], box["weight_of"], tuple(kept))

    def keep(self, pullback: Any) -> list:
        leaves = jax.tree.leaves(pullback)
        kept = [leaf for leaf, w in zip(leaves, self.weight_of) if w < 0]
        got = [(k.shape, k.dtype) for k in kept]
        if got != [(k.shape, k.dtype) for k in self.kept]:
            raise AssertionError(f"a chunk's pullback differs from the stash's trace: {got} vs {self.kept}")
        return kept

    def pullback(self, kept: list, layers: Any) -> Callable:
        weights, kept = jax.tree.leaves(layers), iter(kept)
        return jax.tree.unflatten(self.treedef, [next(kept) if w < 0 else weights[w] for w in self.weight_of])


def chunk_ops(decoder: Decoder, n_layers: int, split_backward: bool, example: tuple[Any, ...]
              ) -> tuple[dict[tuple[int, int], OpFn], Stash, dict[str, int]]:
    """(kind, position) -> op for chunks of `n_layers` layers, the stash those ops fill and spend, and
    {metric: how many of a chunk's layers sow it}. The ops' layer params are `cast_sites` of the chunk's.
    `example` is (one chunk's layer params, an input [b, T, D], one microbatch[, the chunk's fp8 histories]),
    values or shapes.
    `decoder` must be bound to the mesh the ops run on (inside the executor: the abstract mesh with pp
    manual); its stack builder, head and the step's loss assembly are the ones the whole model uses."""
    rules = decoder.rules
    stack = decoder.stack(n_layers)

    def run(lp, x_btd, mb: Batch, meta):
        """-> (y, the chunk's sown collections). `meta`: the chunk's fp8_delayed histories, or {}."""
        variables = {"params": lp, **({FP8_META: meta} if meta else {})}
        (y_btd, _), sown = stack.apply(variables, x_btd, seq_info(mb.positions, mb.segment_ids, decoder.cfg, rules),
                                       mutable=(LOSSES, METRICS))
        return y_btd, sown

    def chunk(lp, x_btd, mb: Batch, meta):
        """((y, the chunk's auxiliary loss), its sown metrics): the differentiated pair, and what is logged."""
        y_btd, sown = run(lp, x_btd, mb, meta)
        return (y_btd, aux_loss(sown)), sown

    def vjp_chunk(lp, x_btd, mb: Batch, meta):
        # The histories are differentiated too: their cotangent is the next histories (fp8.per_tensor_matmul).
        return jax.vjp(lambda lp, x_btd, meta: chunk(lp, x_btd, mb, meta), lp, x_btd, meta, has_aux=True)

    def logged(sown, n):
        return {name: n * total for name, (total, _) in sown_sums(sown.get(METRICS, {})).items()}

    def embed(sh, mb: Batch):
        return decoder.apply({"params": sh}, mb.tokens, method=Decoder.embed)

    def loss_sum(lp, sh, x_btd, meta, mb: Batch, scale):
        y_btd, sown = run(lp, x_btd, mb, meta)
        h_btd, head_dv = decoder.apply({"params": sh}, y_btd, method=Decoder.head)
        ce, n = cross_entropy(decoder, h_btd, head_dv, mb.targets)
        loss = objective(ce, n, sown)[0]
        return loss * scale, (loss, ce, n, logged(sown, n))

    example_lp, example_x, example_mb, example_meta = (*example, {})[:4]
    stash = Stash.of(vjp_chunk, example_lp, example_x, example_mb, example_meta)
    sown_shapes = jax.eval_shape(lambda lp, x, mb, meta: run(lp, x, mb, meta)[1], example_lp, example_x, example_mb,
                                 example_meta)
    layers_sowing = {name: count for name, (_, count) in sown_sums(sown_shapes.get(METRICS, {})).items()}

    def forward(pos: int) -> OpFn:
        def op(lp, sh, x, dy, mb, scale, kept, meta=None):
            if pos == LAST:
                return OpOut()  # its B runs it (module docstring)
            x_btd = embed(sh, mb) if pos == FIRST else x
            (y_btd, aux), pullback, sown = vjp_chunk(lp, x_btd, mb, meta or {})
            n = label_count(mb.targets)
            return OpOut(message=rules.constrain(y_btd, RESIDUAL), kept=stash.keep(pullback), loss=n * aux,
                         metrics=logged(sown, n))
        return op

    def last_backward(lp, sh, x, dy, mb, scale, kept, meta=None):
        grad = jax.grad(loss_sum, argnums=(0, 1, 2, 3), has_aux=True)
        (d_lp, d_sh, dx, d_meta), (loss, ce, n, metrics) = grad(lp, sh, x, meta or {}, mb, scale)
        return OpOut(d_layers=d_lp, d_shared=d_sh, message=rules.constrain(dx, RESIDUAL), loss=loss, count=n, ce=ce,
                     metrics=metrics, meta=d_meta if meta else None)

    def backward(kind: int, pos: int) -> OpFn:
        if pos == LAST:  # split or not, B runs the whole last chunk and its W has nothing left to do
            return last_backward if kind == B else lambda *args: OpOut()
        want_w = kind == W or not split_backward  # the weights' gradient
        want_x = kind == B and pos != FIRST  # the input's, sent on to the chunk before

        def op(lp, sh, x, dy, mb, scale, kept, meta=None):
            if not (want_w or want_x):  # split B of the first chunk: nobody waits for its input gradient
                return OpOut()
            # Unused outputs of the pullback (dW at a split B, dx at a W) are dead code to the compiler.
            d_aux = scale * label_count(mb.targets)  # the chunk's aux loss enters the objective as n·aux
            d_lp, dx_btd, d_meta = stash.pullback(kept, lp)((dy, d_aux))
            d_sh = None
            if want_w and pos == FIRST:
                d_sh = jax.vjp(lambda sh: embed(sh, mb), sh)[1](dx_btd)[0]
            return OpOut(d_layers=d_lp if want_w else None, d_shared=d_sh,
                         message=rules.constrain(dx_btd, RESIDUAL) if want_x else None,
                         meta=d_meta if meta and (want_x or pos == FIRST) else None)
        return op

    kinds = (B, W) if split_backward else (B,)
    ops = {(F, pos): forward(pos) for pos in (FIRST, MID, LAST)}
    ops |= {(kind, pos): backward(kind, pos) for kind in kinds for pos in (FIRST, MID, LAST)}
    return ops, stash, layers_sowing
