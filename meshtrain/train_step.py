"""The training state and the jitted step: pure, explicitly sharded, state donated.

One step = scan over `grad_accum` microbatches (loss and gradient summed over tokens), divide by the
step's total token count, clip, AdamW. Auxiliary losses (MoE load balance, router z-loss) come from
the model's `losses` collection, the one loss channel: each is a per-token mean, added to the
microbatch's loss sum weighted by its token count. Its `metrics` collection is logged beside the loss.
A step whose loss or gradient norm is not finite leaves the parameters and optimizer state untouched
and is counted; the host decides when to give up.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from meshtrain.config import Config, fp8_exclude_patterns, padded_vocab
from meshtrain.data import Batch, Batches
from meshtrain.model.loss import cross_entropy_sum
from meshtrain.model.moe import LOSSES, METRICS
from meshtrain.model.transformer import Decoder, init_variables
from meshtrain.optim import lr_schedule, make_optimizer
from meshtrain.precision import Precision, update_loss_scale
from meshtrain.sharding import ZeroLayout, make_rules, replicated

BATCH = (None, "batch", None)  # every Batch field [A microbatches, B/A sequences, T]


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32: optimizer steps taken, also the data position (batch = f(seed, step))
    params: Any
    # Model variables that are not trained by the optimizer, by collection: {"fp8_meta": amax
    # histories} under precision.matmul=fp8_delayed, else {}. Sharded like the params (same logical
    # names, stacked on `layers`), checkpointed with them; the backward pass returns their next value.
    model_state: Any
    opt_state: Any
    nonfinite_run: jax.Array  # int32: consecutive skipped steps (reset by a finite one)
    nonfinite_total: jax.Array  # int32: all skipped steps
    loss_scale: jax.Array  # fp32: the loss is multiplied by it before differentiation (1 unless fp16)
    scale_good_steps: jax.Array  # int32: finite steps since the loss scale last changed


@dataclass(frozen=True)
class Setup:
    """Everything the step needs that is derived once from the config and the mesh."""

    cfg: Config
    mesh: Mesh
    layout: ZeroLayout
    model: Decoder
    optimizer: optax.GradientTransformation
    state_shardings: TrainState
    grad_shardings: Any  # params-shaped: where gradients live (ZeRO-2/3: sharded over fsdp)
    batch_sharding: NamedSharding

    @property
    def micro_batch(self) -> int:
        return self.cfg.train.global_batch // self.cfg.train.grad_accum

    @property
    def batch_shape(self) -> tuple[int, int, int]:
        """Shape of every Batch field: [A microbatches, B/A sequences, T]."""
        return self.cfg.train.grad_accum, self.micro_batch, self.cfg.data.seq_len

    def abstract_batch(self) -> Batch:
        """The step's batch input as sharded shapes (for AOT lowering without data)."""
        spec = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
        return Batch(tokens=spec, targets=spec, positions=spec, segment_ids=spec)


def build_setup(cfg: Config, mesh: Mesh) -> Setup:
    pc = cfg.precision
    policy = Precision.from_names(pc.compute, pc.params, pc.matmul, fp8_exclude_patterns(pc), pc.fp8_amax_history)
    layout = make_rules(mesh, zero_stage=cfg.train.zero_stage, sequence_parallel=cfg.parallel.sequence_parallel,
                        n_kv_heads=cfg.model.n_kv_heads)
    model_cfg = cfg.model
    if mesh.shape["pp"] > 1 and model_cfg.attention == "auto":  # the fused kernels don't compile in a stage yet
        model_cfg = dataclasses.replace(model_cfg, attention="reference")
    model = Decoder(model_cfg, policy, layout.params, padded_vocab(cfg.model, mesh.shape["tp"]), cfg.train.remat,
                    document_mask=cfg.data.document_mask, moe=cfg.moe if cfg.moe.enabled else None,
                    parallel=cfg.parallel)
    optimizer = make_optimizer(cfg.train)

    tokens_spec = jax.ShapeDtypeStruct((cfg.train.global_batch // cfg.train.grad_accum, cfg.data.seq_len), jnp.int32)
    # Shapes and logical names only: nothing is computed or allocated here.
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens_spec, tokens_spec, tokens_spec)
    boxed = variables["params"]
    logical = nn.get_partition_spec(boxed)
    model_state_sh = layout.params.tree_shardings(nn.get_partition_spec(_model_state(variables)))
    param_sh = layout.params.tree_shardings(logical)
    opt_param_sh = layout.opt_state.tree_shardings(logical)
    abstract_opt = jax.eval_shape(optimizer.init, nn.unbox(boxed))
    # Optimizer moments mirror the params (ZeRO-1 layout); scalars such as the step count replicate.
    opt_sh = optax.tree_map_params(optimizer, lambda _, sh: sh, abstract_opt, opt_param_sh,
                                   transform_non_params=lambda _: replicated(mesh))
    rep = replicated(mesh)
    state_sh = TrainState(step=rep, params=param_sh, model_state=model_state_sh, opt_state=opt_sh, nonfinite_run=rep,
                          nonfinite_total=rep, loss_scale=rep, scale_good_steps=rep)
    return Setup(cfg, mesh, layout, model, optimizer, state_sh, layout.grads.tree_shardings(logical),
                 layout.params.sharding(BATCH))


def _model_state(variables: dict) -> dict:
    """Every variable collection but the params (model_state of TrainState)."""
    return {k: v for k, v in variables.items() if k not in ("params", LOSSES, METRICS)}  # sown: per apply


def make_batches(setup: Setup, split: str = "train") -> Batches:
    """The run's batches (or its eval batches: split="eval"), laid out and sharded as the step takes them."""
    c = setup.cfg
    return Batches(c.data, vocab_size=c.model.vocab_size, global_batch=c.train.global_batch,
                   grad_accum=c.train.grad_accum, seed=c.train.seed, sharding=setup.batch_sharding,
                   cp=setup.mesh.shape["cp"], cp_layout=c.parallel.cp_layout, split=split)


def init_state(setup: Setup) -> TrainState:
    """Parameters drawn from `train.seed`, created already sharded (identical on any mesh, scanned or not)."""

    def init(key):
        tokens = jnp.zeros((setup.micro_batch, setup.cfg.data.seq_len), jnp.int32)
        variables = init_variables(setup.model, key, tokens)
        return fresh_state(setup, variables["params"], _model_state(variables))

    return jax.jit(init, out_shardings=setup.state_shardings)(jax.random.key(setup.cfg.train.seed))


def fresh_state(setup: Setup, params: Any, model_state: Any) -> TrainState:
    """Step 0 around given parameters and model state: optimizer state initialized, counters zero."""
    zero = jnp.zeros((), jnp.int32)
    scale = setup.cfg.precision.loss_scale_init if setup.cfg.precision.compute == "float16" else 1.0
    return TrainState(step=zero, params=params, model_state=model_state, opt_state=setup.optimizer.init(params),
                      nonfinite_run=zero, nonfinite_total=zero, loss_scale=jnp.asarray(scale, jnp.float32), scale_good_steps=zero)


def state_from_params(setup: Setup, params: Any) -> TrainState:
    """A fresh state around loaded parameters (e.g. a Hugging Face model), already sharded."""
    def state(p):
        # The model state (fp8 amax histories) starts as a fresh run's; the unused parameter init is
        # dead code that the compiler drops.
        tokens = jnp.zeros((setup.micro_batch, setup.cfg.data.seq_len), jnp.int32)
        variables = init_variables(setup.model, jax.random.key(0), tokens)
        return fresh_state(setup, p, _model_state(variables))

    return jax.jit(state, out_shardings=setup.state_shardings)(params)


def abstract_params(setup: Setup) -> Any:
    """The parameters as ShapeDtypeStructs carrying their shardings (nothing is allocated)."""
    shapes = jax.eval_shape(lambda: init_state(setup)).params
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                        setup.state_shardings.params)


def sown_means(tree: Any) -> dict[str, jax.Array]:
    """A sown collection -> {name: mean over every layer that sowed it}."""
    groups: dict[str, list[jax.Array]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = next(k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))
        groups.setdefault(name, []).append(jnp.ravel(leaf))
    return {k: jnp.mean(jnp.concatenate(v)) for k, v in groups.items()}


def loss_sum_fn(setup: Setup) -> Callable[..., tuple[jax.Array, jax.Array, dict]]:
    """(params, one microbatch [B, T] each field, model_state) -> (objective summed over labelled tokens, their
    count, token-weighted sums to log: `loss` the cross-entropy, and the model's sown metrics)."""
    cfg = setup.cfg

    def loss_sum(params, mb: Batch, model_state=None):
        variables = {"params": params, **(model_state or {})}
        (h_btd, head_dv), sown = setup.model.apply(variables, mb.tokens, mb.positions, mb.segment_ids,
                                                   mutable=(LOSSES, METRICS))
        ce, n = cross_entropy_sum(h_btd, head_dv, mb.targets, policy=setup.model.policy,
                                  rules=setup.layout.params, vocab_size=cfg.model.vocab_size, impl=cfg.model.loss)
        aux = sum((jnp.sum(x) for x in jax.tree.leaves(sown.get(LOSSES, {}))), jnp.zeros((), jnp.float32))
        logged = {"loss": ce} | {k: v * n for k, v in sown_means(sown.get(METRICS, {})).items()}
        return ce + aux * n, n, logged

    return loss_sum


def make_grad_fn(setup: Setup) -> Callable[..., tuple[Any, jax.Array, jax.Array, Any, dict]]:
    """(params, Batch [A, m, T], scale=1.0, model_state={}) -> (gradient of scale * loss sum, loss sum,
    token count, next model_state, token-weighted sums to log), summed over microbatches. The loss sum
    includes the auxiliary losses.

    The model state's "gradient" is its next value (the fp8 ops return the updated amax histories as
    their cotangent), so it is threaded through the microbatches instead of summed.
    """
    if setup.mesh.shape["pp"] > 1:  # the pipeline executor owns the microbatch loop
        from meshtrain.parallel.pipeline import make_pipeline_grad_fn
        return make_pipeline_grad_fn(setup)
    loss_sum = loss_sum_fn(setup)

    def scaled_loss_sum(params, mb, model_state, scale):
        loss, n, logged = loss_sum(params, mb, model_state)
        return loss * scale, (loss, n, logged)  # scale 1.0 (all but fp16) multiplies exactly

    def micro(params, mb, scale, model_state):
        (_, (loss, n, logged)), (grads, model_state) = jax.value_and_grad(
            scaled_loss_sum, argnums=(0, 2), has_aux=True)(params, mb, model_state, scale)
        # ZeRO-2/3: gradients leave the backward pass reduce-scattered over fsdp, not all-reduced.
        return jax.lax.with_sharding_constraint(grads, setup.grad_shardings), loss, n, model_state, logged

    def grad_fn(params, batch: Batch, scale=1.0, model_state=None):
        model_state = {} if model_state is None else model_state
        if batch.tokens.shape[0] == 1:
            return micro(params, batch.microbatch(0), scale, model_state)

        def body(carry, mb):
            acc, state = carry
            grads, loss, n, state, logged = micro(params, mb, scale, state)
            return (jax.tree.map(jnp.add, acc, (grads, loss, n, logged)), state), None

        logged = jax.eval_shape(loss_sum, params, batch.microbatch(0), model_state)[2]  # names only: traced, not run
        zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
                 {k: jnp.zeros((), jnp.float32) for k in logged})
        ((grads, loss, n, logged), model_state), _ = jax.lax.scan(body, (zeros, model_state), batch)
        return grads, loss, n, model_state, logged

    return grad_fn


def make_train_step(setup: Setup) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """The jitted step: (state, Batch [A, m, T]) -> (state, metrics). The input state is donated."""
    grad_fn = make_grad_fn(setup)
    schedule = lr_schedule(setup.cfg.train)
    fp16 = setup.cfg.precision.compute == "float16"
    micro_tokens = setup.micro_batch * setup.cfg.data.seq_len

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        # fp16: differentiate loss_scale * (per-token mean loss of a microbatch), the usual scaled
        # objective; scaling the token *sum* would overflow fp16 cotangents. Other dtypes: no scaling.
        mult = state.loss_scale / micro_tokens if fp16 else 1.0
        grad_sum, loss_sum, n_tokens, model_state, logged = grad_fn(state.params, batch, mult, state.model_state)
        grads = jax.tree.map(lambda g: g / (n_tokens * mult), grad_sum)
        logged = {k: v / n_tokens for k, v in logged.items()}
        loss = loss_sum / n_tokens  # the objective, auxiliary losses included
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        # The scope names the fused update's kernels in a profile (meshtrain/profile_trace.py).
        with jax.named_scope("optimizer"):
            updates, opt_state = setup.optimizer.update(grads, state.opt_state, state.params)
            params = keep(optax.apply_updates(state.params, updates), state.params)
            opt_state = keep(opt_state, state.opt_state)
        applied = state.step - state.nonfinite_total  # the optimizer's own count: skipped steps don't move it
        scale, good = state.loss_scale, state.scale_good_steps
        if fp16:
            scale, good = update_loss_scale(scale, good, finite,
                                            growth_interval=setup.cfg.precision.loss_scale_growth_interval)
        new_state = TrainState(
            step=state.step + 1, params=params, model_state=keep(model_state, state.model_state), opt_state=opt_state,
            nonfinite_run=jnp.where(finite, 0, state.nonfinite_run + 1),
            nonfinite_total=state.nonfinite_total + (~finite).astype(jnp.int32),
            loss_scale=scale, scale_good_steps=good)
        metrics = dict(objective=loss, grad_norm=grad_norm, lr=schedule(applied), finite=finite, tokens=n_tokens,
                       nonfinite_run=new_state.nonfinite_run, loss_scale=scale, **logged)  # logged: loss, moe_*
        return new_state, metrics

    return jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                   out_shardings=(setup.state_shardings, replicated(setup.mesh)), donate_argnums=0)
