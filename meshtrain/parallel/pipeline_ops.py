"""The ops a pipeline stage runs on one chunk (k consecutive layers) for one microbatch.

Pure per-device functions, no collective over pp: the executor (pipeline.py) calls them inside
its manual region, the benchmark (scripts/bench_pipeline.py) times them alone. A chunk's
position decides what else it runs: the first chunk embeds the tokens, the last computes final
norm, head and loss; a middle one reads the previous chunk's output.

    F  x ─ chunk ─> y                      (first: tokens ─ embed ─ chunk; last: ─ head ─> loss)
    B  x, dy ─ recompute, vjp ─> dx (+ dW when the backward is not split)
    W  x, dy ─ recompute, vjp ─> dW       (split backward only)

B and W recompute the chunk's forward from its stashed input instead of keeping the chunk's
activations from F: a stage holds one [b, T, D] input per microbatch in flight, at the price
of one more chunk forward per B (and per W).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax

from meshtrain.config import Config
from meshtrain.data import Batch
from meshtrain.model.loss import cross_entropy_sum
from meshtrain.model.transformer import RESIDUAL, Decoder, block_stack, seq_info
from meshtrain.parallel.pipeline_plan import B, F, FIRST, LAST, MID, W
from meshtrain.sharding import ShardingRules


@flax.struct.dataclass
class OpOut:
    """What an op yields; None where it yields nothing (a pytree, so an op can be jitted alone)."""

    d_layers: Any = None  # gradient of the chunk's layer params
    d_shared: Any = None  # gradient of embedding / final_norm / lm_head (first and last chunks)
    message: jax.Array | None = None  # y (F) or dx (B), for the neighbouring chunk
    loss: jax.Array | None = None  # loss sum and token count (F of the last chunk)
    count: jax.Array | None = None


OpFn = Callable[[Any, Any, jax.Array, jax.Array, Batch, jax.Array], OpOut]  # (lp, shared, x, dy, mb, scale)


def chunk_ops(cfg: Config, decoder: Decoder, rules: ShardingRules, n_layers: int,
              split_backward: bool) -> dict[tuple[int, int], OpFn]:
    """(kind, position) -> op, for chunks of `n_layers` layers. `decoder` and `rules` must be bound
    to the mesh the ops run on (inside the executor: the abstract mesh with pp manual)."""
    policy = decoder.policy
    stack = block_stack(cfg.model, policy, rules, n_layers=n_layers, remat=cfg.train.remat,
                        document_mask=cfg.data.document_mask, parallel=cfg.parallel)

    def run(lp, x_btd, mb: Batch):
        return stack.apply({"params": lp}, x_btd, seq_info(mb.positions, mb.segment_ids, cfg.model, rules))[0]

    def loss_sum(shared, y_btd, mb: Batch):
        h_btd, head_dv = decoder.apply({"params": shared}, y_btd, method=Decoder.head)
        return cross_entropy_sum(h_btd, head_dv, mb.targets, policy=policy, rules=rules,
                                 vocab_size=cfg.model.vocab_size, impl=cfg.model.loss)

    # The chunk as a function of (its layers, the shared params, its input), by position.
    def first(lp, sh, x, mb, scale):
        return run(lp, decoder.apply({"params": sh}, mb.tokens, method=Decoder.embed), mb)

    def mid(lp, sh, x, mb, scale):
        return run(lp, x, mb)

    def last(lp, sh, x, mb, scale):
        return loss_sum(sh, run(lp, x, mb), mb)[0] * scale

    fns = {FIRST: first, MID: mid, LAST: last}

    def make(kind: int, pos: int) -> OpFn:
        fn = fns[pos]
        if kind == F:
            if pos == LAST:
                def forward_loss(lp, sh, x, dy, mb, scale):
                    loss, count = loss_sum(sh, run(lp, x, mb), mb)
                    return OpOut(loss=loss, count=count)
                return forward_loss
            return lambda lp, sh, x, dy, mb, scale: OpOut(message=rules.constrain(fn(lp, sh, x, mb, scale), RESIDUAL))

        # Which gradients: weights (the layers; the shared params at the ends), the input (not first).
        want_w = kind == W or not split_backward
        want_x = kind == B and pos != FIRST
        argnums = ((0,) if want_w else ()) + ((1,) if want_w and pos != MID else ()) + ((2,) if want_x else ())

        def backward(lp, sh, x, dy, mb, scale):
            if not argnums:  # split B of the first chunk: nobody waits for its input gradient
                return OpOut()
            args = (lp, sh, x)

            def f(*chosen):  # fn of the arguments whose gradients are wanted; the rest are constants
                full = list(args)
                for i, a in zip(argnums, chosen):
                    full[i] = a
                return fn(*full, mb, scale)

            chosen = [args[i] for i in argnums]
            if pos == LAST:  # the scalar loss (scaled inside) starts the backward
                grads = jax.grad(f, argnums=tuple(range(len(argnums))))(*chosen)
            else:
                grads = jax.vjp(f, *chosen)[1](dy)
            got = dict(zip(argnums, grads))
            return OpOut(d_layers=got.get(0), d_shared=got.get(1),
                         message=rules.constrain(got[2], RESIDUAL) if 2 in got else None)

        return backward

    kinds = (F, B, W) if split_backward else (F, B)
    return {(kind, pos): make(kind, pos) for kind in kinds for pos in (FIRST, MID, LAST)}
