"""The training state and what the step is built from: `Setup`, derived once from the config and the mesh.

`build_setup` makes the model, the optimizer and every sharding (parameters, optimizer state, gradients,
batch) from shapes alone (`jax.eval_shape`): nothing is allocated until `init_state`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from meshtrain.config import Config, fp8_exclude_patterns
from meshtrain.data import Batch, Batches, text_cache_dir
from meshtrain.model.moe import LOSSES, METRICS
from meshtrain.model.transformer import Decoder, init_variables
from meshtrain.precision import Precision
from meshtrain.resolve import Execution, resolve_for_mesh
from meshtrain.step.opt_shardings import opt_state_shardings
from meshtrain.step.optim import make_optimizer
from meshtrain.step.pipeline.layout import MODEL_ORDER, reorder, stored_order
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
    exe: Execution  # every `auto` of cfg decided for this mesh (meshtrain/resolve.py)
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

    @property
    def layers_order(self) -> np.ndarray:
        """The order the state keeps the layer stack in: the model's, or the pipeline stages' (the model block at each
        of p·v stored positions; step/pipeline/layout.py)."""
        pc = self.cfg.pipeline
        return stored_order(pc.schedule, self.mesh.shape["pp"], pc.virtual_stages)

    @property
    def stack_rows(self) -> int:
        """The stacked layer leaves' leading rows: the layers, or with MoE layers every few, the groups."""
        return self.cfg.model.n_layers // self.model.every

    def to_stored_order(self, tree: Any) -> Any:
        """Inside a jit: a params-like tree (params, model state, gradients) from the model's order to the state's."""
        return reorder(tree, MODEL_ORDER, self.layers_order, self.stack_rows, self._pp_mesh())

    def to_model_order(self, tree: Any) -> Any:
        """Inside a jit: the inverse of to_stored_order."""
        return reorder(tree, self.layers_order, MODEL_ORDER, self.stack_rows, self._pp_mesh())

    def _pp_mesh(self) -> Mesh | None:
        return self.mesh if self.mesh.shape["pp"] > 1 else None

    def abstract_batch(self) -> Batch:
        """The step's batch input as sharded shapes (for AOT lowering without data)."""
        spec = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
        return Batch(tokens=spec, targets=spec, positions=spec, segment_ids=spec)


def build_setup(cfg: Config, mesh: Mesh) -> Setup:
    pc = cfg.precision
    exe = resolve_for_mesh(cfg, mesh)
    policy = Precision.from_names(pc.compute, pc.params, pc.matmul, fp8_exclude_patterns(pc), pc.fp8_amax_history,
                                  exe.fp8_cast)
    ffn_widths = (cfg.model.d_ff, cfg.moe.expert_ffn(cfg.model)) if cfg.moe.enabled else (cfg.model.d_ff,)
    layout = make_rules(mesh, zero_stage=cfg.train.zero_stage, sequence_parallel=cfg.parallel.sequence_parallel,
                        n_kv_heads=cfg.model.n_kv_heads, n_heads=cfg.model.n_heads, ffn_widths=ffn_widths)
    model = Decoder(cfg.model, policy, layout.params, exe, cfg.train.remat, document_mask=cfg.data.document_mask,
                    moe=cfg.moe if cfg.moe.enabled else None)

    tokens_spec = jax.ShapeDtypeStruct((cfg.train.global_batch // cfg.train.grad_accum, cfg.data.seq_len), jnp.int32)
    # Shapes and logical names only: nothing is computed or allocated here.
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens_spec, tokens_spec, tokens_spec)
    boxed = variables["params"]
    logical = nn.get_partition_spec(boxed)
    optimizer = make_optimizer(cfg.train, logical)
    model_state_sh = layout.params.tree_shardings(nn.get_partition_spec(_model_state(variables)))
    param_sh = layout.params.tree_shardings(logical)
    abstract_params = nn.unbox(boxed)
    # Optimizer state by the parameter it belongs to, in the ZeRO-1 view (step/opt_shardings.py).
    opt_sh = opt_state_shardings(jax.eval_shape(optimizer.init, abstract_params), abstract_params,
                                 layout.opt_state.tree_shardings(logical), mesh)
    rep = replicated(mesh)
    state_sh = TrainState(step=rep, params=param_sh, model_state=model_state_sh, opt_state=opt_sh, nonfinite_run=rep,
                          nonfinite_total=rep, loss_scale=rep, scale_good_steps=rep)
    return Setup(cfg, mesh, exe, layout, model, optimizer, state_sh, layout.grads.tree_shardings(logical),
                 layout.params.sharding(BATCH))


def _model_state(variables: dict) -> dict:
    """Every variable collection but the params (model_state of TrainState)."""
    return {k: v for k, v in variables.items() if k not in ("params", LOSSES, METRICS)}  # sown: per apply


def make_batches(setup: Setup, split: str = "train") -> Batches:
    """The run's batches (or its eval batches: split="eval"), laid out and sharded as the step takes them."""
    c = setup.cfg
    return Batches(c.data, vocab_size=c.model.vocab_size, global_batch=c.train.global_batch,
                   grad_accum=c.train.grad_accum, seed=c.train.seed, sharding=setup.batch_sharding,
                   cp=setup.mesh.shape["cp"], cp_layout=setup.exe.cp_layout, split=split,
                   cache_dir=text_cache_dir(c.data, c.run.dir))


def init_state(setup: Setup) -> TrainState:
    """Parameters drawn from `train.seed`, created already sharded (identical on any mesh, scanned or not), the
    layer stack in the state's order (`Setup.layers_order`)."""

    def init(key):
        tokens = jnp.zeros((setup.micro_batch, setup.cfg.data.seq_len), jnp.int32)
        variables = init_variables(setup.model, key, tokens)
        return fresh_state(setup, setup.to_stored_order(variables["params"]),
                           setup.to_stored_order(_model_state(variables)))

    return jax.jit(init, out_shardings=setup.state_shardings)(jax.random.key(setup.cfg.train.seed))


def fresh_state(setup: Setup, params: Any, model_state: Any) -> TrainState:
    """Step 0 around given parameters and model state: optimizer state initialized, counters zero."""
    zero = jnp.zeros((), jnp.int32)
    scale = setup.cfg.precision.loss_scale_init if setup.cfg.precision.compute == "float16" else 1.0
    return TrainState(step=zero, params=params, model_state=model_state, opt_state=setup.optimizer.init(params),
                      nonfinite_run=zero, nonfinite_total=zero, loss_scale=jnp.asarray(scale, jnp.float32), scale_good_steps=zero)


def state_from_params(setup: Setup, params: Any) -> TrainState:
    """A fresh state around loaded parameters in the model's order (e.g. a Hugging Face model), already sharded."""
    def state(p):
        # The model state (fp8 amax histories) starts as a fresh run's; the unused parameter init is
        # dead code that the compiler drops.
        tokens = jnp.zeros((setup.micro_batch, setup.cfg.data.seq_len), jnp.int32)
        variables = init_variables(setup.model, jax.random.key(0), tokens)
        return fresh_state(setup, setup.to_stored_order(p), setup.to_stored_order(_model_state(variables)))

    return jax.jit(state, out_shardings=setup.state_shardings)(params)


def abstract_params(setup: Setup) -> Any:
    """The parameters as ShapeDtypeStructs carrying their shardings (nothing is allocated); the order of the layer
    stack is not in the shapes."""
    shapes = jax.eval_shape(lambda: init_state(setup)).params
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                        setup.state_shardings.params)


