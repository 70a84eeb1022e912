"""The ops a pipeline stage runs on one chunk (k consecutive layers) for one microbatch.

Pure per-device functions, no collective over pp: the executor (executor.py) calls them inside
its manual region, the benchmark (scripts/bench_pipeline.py) times them alone. A chunk's
position decides what else it runs: the first chunk embeds the tokens, the last computes final
norm, head and loss; a middle one reads the previous chunk's output.

    F  x ─ chunk ─> y, and the chunk's pullback kept        (first: tokens ─ embed ─ chunk)
    B  dy, the kept pullback ─> dx (+ dW when the backward is not split)
    W  the sites' inputs (F) and outputs' gradients (B) ─> dW  (split backward only: weight_grads.py)
    the last chunk: F does nothing; B runs chunk, head, loss and the whole backward from its x (split: all but
    the sites' weight gradients, which its W computes as a middle chunk's does)

MoE layers sow auxiliary losses and router metrics (model/moe.py). A chunk's output is then the pair
(y, aux): aux the sum of its sown losses, which enters the objective as n·aux (step/loss.py: n labelled
tokens of the microbatch), so its cotangent at B is scale·n beside dy. F reports n·aux as its share of the
loss sum and n·(its layers' sum) of every metric; the executor divides the metric sums by the number of
layers that sow them, as the step without the pipeline takes their mean over layers.

What F keeps is the chunk's jax.vjp pullback (its residuals: what the model's remat policy,
train.remat, saves of each layer), in the stage's stash (`Stash`); B spends it, as a step without
the pipeline spends its residuals, so B costs a backward, not a forward and a backward. The last
chunk keeps nothing: its forward and backward run back to back (B follows F on that stage at once in
every schedule), which spares the stash its logits, under a policy of its own (`last_remat`: by default it keeps
everything where train.remat reruns no matmul, since what one computation keeps costs no stash traffic;
config/pipeline.py).

The ops take a chunk's layer params as the stage holds them for the whole step (`chunk_weights`): the weights
of bf16 matmul sites already cast to the compute dtype (once per step in the executor; a site casts them
anyway, and casting a stage's weights at every op took about 1.2 ms per op for a 1B model's half on an H100),
and taken apart layer by layer, because the ops run their chunk's layers unrolled (a scanned chunk's slices and
stacks were copies: 1F1B at pp=2 went from 293.9 to 208.9 ms on H100s). The gradients come back in that dtype
and layout and are accumulated in fp32. The pullback's residuals include
those weights (a matmul's input gradient needs them); they are not kept per microbatch: the pullback holds
the very arrays the stage reads again at B, and the stash stores only the rest.

A split backward (zb_h1, dualpipe_v) also keeps, per microbatch, each plain matmul site's input (from F) and
its output's gradient (from B), so that W is one matmul per site (weight_grads.py). That is one more copy of
the site inputs than the pullback holds, between F and W, and the sites' output gradients between B and W.
The last chunk's B keeps both (its forward runs there), so that its W, too, can wait behind later ops where the
schedule defers it: ZB-H1's cool-down, where the input gradient of the last microbatch is what every stage
before waits for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from meshtrain.data import Batch
from meshtrain.model.loss import label_count
from meshtrain.model.moe import LOSSES, METRICS
from meshtrain.model.layers import FP8_META, SITE_GRADS, SITE_INPUTS
from meshtrain.model.transformer import RESIDUAL, Decoder, seq_info, unrolled_layers
from meshtrain.step.loss import aux_loss, cross_entropy, objective, site_weights, sown_sums
from meshtrain.step.pipeline.ticks import B, F, FIRST, LAST, MID, W
from meshtrain.step.pipeline.weight_grads import site_weight_grads, without_site_grads


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
    kept: list | None = None  # what the op leaves in its stash slot (Stash), None where a buffer keeps its value
    meta: Any = None  # fp8_delayed: the chunk's amax histories with this microbatch's amaxes pushed (one op per
    # microbatch reports them: the one that runs the pullback for the input gradient, or for the first chunk's W)


# (layer params, shared params, x, dy, microbatch, scale, the stash's leaves for this op, the chunk's fp8
# histories or {}) -> OpOut
OpFn = Callable[[Any, Any, jax.Array, jax.Array, Batch, jax.Array, list, Any], OpOut]



@dataclass(frozen=True)
class Stash:
    """What a microbatch of a chunk leaves in its stash slot between its ops, as a list of buffers: F's pullback
    (its leaves less those that are the chunk's cast weights), then, for a split backward, the tapped sites'
    inputs (F) and their outputs' gradients (B), which W reads.

    `treedef` and `weight_of` come from one abstract trace of the chunk (`Stash.of`); every chunk
    before the last has k layers and so the same pullback structure."""

    treedef: Any
    weight_of: tuple[int, ...]  # per pullback leaf: the index of the weight leaf it is, or -1 (kept)
    kept: tuple[jax.ShapeDtypeStruct, ...]  # the pullback's leaves kept per microbatch
    inputs: Any  # the tapped sites' inputs (a tree of shapes; {} without a split backward)
    grads: Any  # the tapped sites' output gradients (likewise)

    @classmethod
    def of(cls, vjp_chunk: Callable, layers: Any, x_btd: Any, mb: Any, meta: Any, taps: Any, inputs: Any
           ) -> "Stash":
        box = {}

        def trace(layers, x_btd, mb, meta, taps):
            leaves, box["treedef"] = jax.tree.flatten(vjp_chunk(layers, x_btd, mb, meta, taps)[1])
            weights = jax.tree.leaves(layers)
            box["weight_of"] = tuple(next((i for i, w in enumerate(weights) if w is leaf), -1) for leaf in leaves)
            return [leaf for leaf, w in zip(leaves, box["weight_of"]) if w < 0]

        kept = jax.eval_shape(trace, layers, x_btd, mb, meta, taps)
        return cls(box["treedef"], box["weight_of"], tuple(kept), inputs, taps)

    @property
    def buffers(self) -> list[jax.ShapeDtypeStruct]:
        return [*self.kept, *jax.tree.leaves(self.inputs), *jax.tree.leaves(self.grads)]

    def _spans(self) -> tuple[slice, slice, slice]:
        n, m = len(self.kept), len(jax.tree.leaves(self.inputs))
        return slice(0, n), slice(n, n + m), slice(n + m, None)

    def after_forward(self, pullback: Any, inputs: Any) -> list:
        """F's buffers: the pullback's kept leaves and the site inputs (None: untouched, as the gradients')."""
        leaves = jax.tree.leaves(pullback)
        kept = [leaf for leaf, w in zip(leaves, self.weight_of) if w < 0]
        got = [(k.shape, k.dtype) for k in kept]
        if got != [(k.shape, k.dtype) for k in self.kept]:
            raise AssertionError(f"a chunk's pullback differs from the stash's trace: {got} vs {self.kept}")
        n_inputs, n_grads = len(jax.tree.leaves(self.inputs)), len(jax.tree.leaves(self.grads))
        return [*kept, *(jax.tree.leaves(inputs) if inputs is not None else [None] * n_inputs), *[None] * n_grads]

    def after_backward(self, grads: Any) -> list:
        """A split B's buffers: the sites' output gradients (the rest untouched)."""
        return [*[None] * (len(self.kept) + len(jax.tree.leaves(self.inputs))), *jax.tree.leaves(grads)]

    def after_last_backward(self, inputs: Any, grads: Any) -> list:
        """The split last chunk's B: the sites' inputs and output gradients (it keeps no pullback)."""
        return [*[None] * len(self.kept), *jax.tree.leaves(inputs), *jax.tree.leaves(grads)]

    @staticmethod
    def written(buffers: list, kept: list) -> list:
        """A slot's buffers after an op left `kept` in it (None: that buffer keeps its value)."""
        return [old if new is None else new for old, new in zip(buffers, kept)]

    def pullback(self, buffers: list, layers: Any) -> Callable:
        weights, kept = jax.tree.leaves(layers), iter(buffers[self._spans()[0]])
        return jax.tree.unflatten(self.treedef, [next(kept) if w < 0 else weights[w] for w in self.weight_of])

    def site_inputs(self, buffers: list) -> Any:
        return jax.tree.unflatten(jax.tree.structure(self.inputs), buffers[self._spans()[1]])

    def site_grads(self, buffers: list) -> Any:
        return jax.tree.unflatten(jax.tree.structure(self.grads), buffers[self._spans()[2]])


def chunk_weights(decoder: Decoder, layers: Any, n_layers: int) -> Any:
    """What the ops read as a chunk's layer params: its stacked layers [k, ...] with the bf16 sites cast and the
    `fp8` sites quantized (step/loss.py `site_weights`, once per step; an `fp8_delayed` site reads its histories
    as they stand at each op, so it quantizes there) and taken apart into `layer_i` subtrees, once per step too.
    The ops run the chunk's layers one by one (an unrolled stack): a scanned chunk slices every layer's weights and
    stacks every layer's residuals and gradients inside its loop, and on GPUs those slices and stacks were copies
    (the one-GPU 1B step at 8 microbatches of one sequence: 496 ms scanned, 358 ms unrolled, docs/PERFORMANCE.md).
    The gradients come back in the same `layer_i` form (a quantized weight's as its fp8.QuantizedWeight, whose
    master holds it: fp8.master_grads); the executor stacks them once at the end of the step."""
    return unrolled_layers(site_weights(decoder, layers), n_layers, decoder.every)


def chunk_ops(decoder: Decoder, n_layers: int, split_backward: bool, example: tuple[Any, ...],
              last_remat: str | None = None) -> tuple[dict[tuple[int, int], OpFn], Stash, dict[str, int]]:
    """(kind, position) -> op for chunks of `n_layers` layers, the stash those ops fill and spend, and
    {metric: how many of a chunk's layers sow it}. The ops' layer params are `chunk_weights`.
    `example` is (one chunk's layer params, an input [b, T, D], one microbatch[, the chunk's fp8 histories]),
    values or shapes. `last_remat`: the last chunk's remat policy (PipelineRun.last_chunk_remat; None: the
    decoder's, as every other chunk's).
    `decoder` must be bound to the mesh the ops run on (inside the executor: the abstract mesh with pp
    manual); its stack builder, head and the step's loss assembly are the ones the whole model uses."""
    rules = decoder.rules
    stack = decoder.stack(n_layers, scan=False)  # chunk_weights: the ops take their layers one by one
    # Its F and B run in one op: what it keeps never waits in the stash (config/pipeline.py: last_chunk_remat).
    # Split, only its sites' inputs and output gradients wait there, for its W.
    last_stack = decoder.clone(remat=last_remat).stack(n_layers, scan=False) if last_remat else stack
    tapped = split_backward  # a split backward's middle and last chunks record their sites' inputs
    taps_sown = (SITE_INPUTS,) if tapped else ()

    def run(lp, x_btd, mb: Batch, meta, taps, sown=(LOSSES, METRICS), blocks=stack):
        """-> (y, the chunk's sown collections). `meta`: the chunk's fp8_delayed histories, or {}; `taps`: the
        zero perturbations of its sites' outputs (SITE_GRADS), or {}."""
        meta = unrolled_layers(meta, n_layers, decoder.every) if meta else {}  # as the stack names its layers
        variables = {"params": lp, **({FP8_META: meta} if meta else {}), **({SITE_GRADS: taps} if taps else {})}
        (y_btd, _), sown = blocks.apply(variables, x_btd, seq_info(mb.positions, mb.segment_ids, decoder.cfg, rules),
                                        mutable=sown)
        return y_btd, sown

    def chunk(lp, x_btd, mb: Batch, meta, taps):
        """((y, the chunk's auxiliary loss), its sown collections): the differentiated pair, and the rest."""
        y_btd, sown = run(lp, x_btd, mb, meta, taps, (LOSSES, METRICS, *taps_sown))
        return (y_btd, aux_loss(sown)), sown

    def vjp_chunk(lp, x_btd, mb: Batch, meta, taps):
        # The histories are differentiated too: their cotangent is the next histories (fp8.per_tensor_matmul).
        # The taps' cotangents are the sites' output gradients.
        return jax.vjp(lambda lp, x_btd, meta, taps: chunk(lp, x_btd, mb, meta, taps), lp, x_btd, meta, taps,
                       has_aux=True)

    def logged(sown, n):
        return {name: n * total for name, (total, _) in sown_sums(sown.get(METRICS, {})).items()}

    def embed(sh, mb: Batch):
        return decoder.apply({"params": sh}, mb.tokens, method=Decoder.embed)

    def loss_sum(lp, sh, x_btd, meta, taps, mb: Batch, scale):
        """The last chunk, head and loss; with `taps`, also the sites' inputs (SITE_INPUTS)."""
        y_btd, sown = run(lp, x_btd, mb, meta, taps, sown=(LOSSES, METRICS, *(SITE_INPUTS,) * bool(taps)),
                          blocks=last_stack)
        h_btd, head_dv = decoder.apply({"params": sh}, y_btd, method=Decoder.head)
        ce, n = cross_entropy(decoder, h_btd, head_dv, mb.targets)
        loss = objective(ce, n, sown)[0]
        return loss * scale, (loss, ce, n, logged(sown, n), sown.get(SITE_INPUTS, {}))

    example_lp, example_x, example_mb, example_meta = (*example, {})[:4]
    # One abstract run: which metrics the layers sow and, for a split backward, the taps (created as zeros when
    # their collection is mutable) and the site inputs.
    sown_shapes = jax.eval_shape(lambda lp, x, mb, meta: run(lp, x, mb, meta, {}, (LOSSES, METRICS, *taps_sown,
                                                                                  *(SITE_GRADS,) * tapped))[1],
                                 example_lp, example_x, example_mb, example_meta)
    taps_shapes = sown_shapes.get(SITE_GRADS, {})
    stash = Stash.of(vjp_chunk, example_lp, example_x, example_mb, example_meta, taps_shapes,
                     sown_shapes.get(SITE_INPUTS, {}))
    layers_sowing = {name: count for name, (_, count) in sown_sums(sown_shapes.get(METRICS, {})).items()}

    def zero_taps():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), taps_shapes)

    def forward(pos: int) -> OpFn:
        def op(lp, sh, x, dy, mb, scale, kept, meta=None):
            if pos == LAST:
                return OpOut()  # its B runs it (module docstring)
            x_btd = embed(sh, mb) if pos == FIRST else x
            (y_btd, aux), pullback, sown = vjp_chunk(lp, x_btd, mb, meta or {}, zero_taps())
            n = label_count(mb.targets)
            # The first chunk's W pulls back whole (`weights`): its site inputs are not needed.
            inputs = sown.get(SITE_INPUTS, {}) if pos == MID else None
            return OpOut(message=rules.constrain(y_btd, RESIDUAL), kept=stash.after_forward(pullback, inputs),
                         loss=n * aux, metrics=logged(sown, n))
        return op

    def last_backward(lp, sh, x, dy, mb, scale, kept, meta=None):
        """The last chunk's forward and backward; split, the tapped sites' weight gradients are left to its W, and
        their inputs and output gradients go into its stash slot."""
        taps = zero_taps() if split_backward else {}
        grad = jax.grad(loss_sum, argnums=(0, 1, 2, 3, 4), has_aux=True)
        (d_lp, d_sh, dx, d_meta, d_taps), (loss, ce, n, metrics, inputs) = grad(lp, sh, x, meta or {}, taps, mb,
                                                                                 scale)
        if split_backward:
            d_lp = without_site_grads(d_lp, d_taps)
        return OpOut(d_layers=d_lp, d_shared=d_sh, message=rules.constrain(dx, RESIDUAL), loss=loss, count=n, ce=ce,
                     metrics=metrics, meta=d_meta if meta else None,
                     kept=stash.after_last_backward(inputs, d_taps) if split_backward else None)

    def pullback(lp, dy, mb, scale, kept):
        """(d layers, dx, d histories, d taps): the chunk's pullback from the stash."""
        d_aux = scale * label_count(mb.targets)  # the chunk's aux loss enters the objective as n·aux
        return stash.pullback(kept, lp)((dy, d_aux))

    def first_backward(lp, sh, x, dy, mb, scale, kept, meta=None):
        """The first chunk's whole backward: its input gradient is the embedding's."""
        d_lp, dx_btd, d_meta, _ = pullback(lp, dy, mb, scale, kept)
        return OpOut(d_layers=d_lp, d_shared=jax.vjp(lambda sh: embed(sh, mb), sh)[1](dx_btd)[0],
                     meta=d_meta if meta else None)

    def backward(pos: int) -> OpFn:
        """B: the input gradient, sent on to the chunk before, and the weight gradients. A split B leaves the
        tapped sites' weight gradients to W, and the first chunk's whole backward, which nobody waits for."""
        if pos == LAST:  # the chunk's forward too (split: less its sites' weight gradients)
            return last_backward
        if pos == FIRST:
            return (lambda *args: OpOut()) if split_backward else first_backward

        def op(lp, sh, x, dy, mb, scale, kept, meta=None):
            d_lp, dx_btd, d_meta, d_taps = pullback(lp, dy, mb, scale, kept)
            return OpOut(d_layers=without_site_grads(d_lp, d_taps) if split_backward else d_lp,
                         message=rules.constrain(dx_btd, RESIDUAL),
                         kept=stash.after_backward(d_taps) if split_backward else None,
                         meta=d_meta if meta else None)
        return op

    def weights(pos: int) -> OpFn:
        """W of a split backward: the tapped sites' weight gradients, one matmul each (weight_grads.py), for a
        middle or the last chunk; the first chunk's whole backward (its B does nothing)."""
        if pos == FIRST:
            return first_backward

        def op(lp, sh, x, dy, mb, scale, kept, meta=None):
            return OpOut(d_layers=site_weight_grads(lp, stash.site_inputs(kept), stash.site_grads(kept)))
        return op

    ops = {(F, pos): forward(pos) for pos in (FIRST, MID, LAST)}
    ops |= {(B, pos): backward(pos) for pos in (FIRST, MID, LAST)}
    if split_backward:
        ops |= {(W, pos): weights(pos) for pos in (FIRST, MID, LAST)}
    return ops, stash, layers_sowing
