"""Every `auto` of a config, decided once: `Execution = resolve(cfg, degrees, backend)`.

The config says what the user wants ("auto" where they leave it to meshtrain); the Execution says what
will run, on this mesh and backend. It is frozen and printable (the start-up banner prints it), and
everything that needs a decision reads it instead of deciding again: the model and its kernels, the
step, the memory guard, the planner and the inspector. Nothing below this module reads the backend.

    attention        reference | cudnn | pallas      auto: cudnn on a GPU in bf16/fp16, pallas there when
                                                     documents are masked or the sequence is split over
                                                     cp/sp, reference elsewhere
    attention_kernel mosaic | triton | ""            the Pallas attention's kernels (auto: Mosaic where it
                                                     can run, Triton elsewhere); "" unless attention=pallas
    interpret        the Pallas kernels run in interpret mode (CPU: tests)
    moe_exchange     allgather | padded | ""         dropless exchange over ep (auto: allgather)
    moe_gemm         ragged_dot | pallas | ""        expert GEMMs (auto: the gmm kernel on GPUs where its
                                                     packages are, ragged_dot elsewhere)
    moe_fp32         XLA:CPU cannot compile the bf16 expert region on several devices: CPUs run it in fp32
    tp_ring          tensor parallelism's matmuls run as shard_map rings (parallel.tp_overlap)
    pipeline         the schedule the pipeline executor runs (None without mesh.pp > 1), and its last chunk's
                     remat policy (auto: none where train.remat recomputes no matmul, config/pipeline.py)
    vocab_padded     the vocabulary rounded up so that tp divides it
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import jax.numpy as jnp

import pallas_kernels as pk
from meshtrain.config import Config, ConfigError, padded_vocab
from meshtrain.config.pipeline import last_chunk_remat

FUSED_DTYPES = (jnp.bfloat16, jnp.float16)  # the fused attention implementations' compute dtypes


@dataclass(frozen=True)
class PipelineRun:
    """The schedule a pipeline runs: `schedule` over `stages` stages of `virtual_stages` chunks each."""

    schedule: str
    stages: int
    virtual_stages: int
    microbatches: int
    last_chunk_remat: str  # config.pipeline.last_chunk_remat: the remat policy of the chunk that computes the loss

    def describe(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"{self.schedule}{v} over {self.stages} stages, {self.microbatches} microbatches, "
                f"last chunk remat {self.last_chunk_remat}")


@dataclass(frozen=True)
class Execution:
    """What runs (module docstring); equal for equal (config, degrees, backend)."""

    backend: str
    attention: str
    attention_kernel: str
    interpret: bool
    norm: str
    loss: str
    cp_impl: str
    cp_layout: str
    sequence_sharded: bool
    tp_ring: bool
    moe_exchange: str
    moe_gemm: str
    moe_fp32: bool
    fp8_cast: str  # fp8.CASTS: how the per-tensor fp8 recipes quantize ("" without one)
    pipeline: PipelineRun | None
    vocab_padded: int

    @property
    def fused_attention(self) -> bool:
        """Attention that keeps no [T, S] scores (what the memory estimate needs to know)."""
        return self.attention != "reference"

    def describe(self) -> str:
        """One line for the start-up banner."""
        attn = self.attention + (f"/{self.attention_kernel}" if self.attention_kernel else "")
        parts = [f"attention {attn}"]
        if self.sequence_sharded:
            parts.append(f"cp {self.cp_impl}/{self.cp_layout}")
        if self.norm != "reference" or self.loss != "reference":
            parts.append(f"norm {self.norm}, loss {self.loss}")
        if self.tp_ring:
            parts.append("tp collective-matmul rings")
        if self.moe_exchange or self.moe_gemm:
            parts.append(f"experts {self.moe_exchange or 'local'}/{self.moe_gemm}" + (" fp32" if self.moe_fp32 else ""))
        if self.fp8_cast and self.fp8_cast != "xla":
            parts.append(f"fp8 cast {self.fp8_cast}")
        if self.pipeline:
            parts.append(f"pipeline {self.pipeline.describe()}")
        if self.interpret:
            parts.append("kernels interpreted")
        return ", ".join(parts)


def resolve(cfg: Config, degrees: Mapping[str, int], backend: str, *, packages_here: bool = True) -> Execution:
    """Decide every `auto` of `cfg` for a mesh of these degrees on this backend ("cpu", "gpu", "tpu").
    Raises ConfigError where an explicit choice cannot run here. `packages_here=False` decides for another
    machine (the planner): the optional kernel packages are assumed installed there, not looked for here."""
    m, moe = cfg.model, cfg.moe
    interpret = backend == "cpu"
    sequence_sharded = degrees["cp"] * degrees["sp"] > 1
    pipelined = degrees["pp"] > 1
    compute = jnp.dtype(cfg.precision.compute)
    attention = _attention(m.attention, backend, compute, cfg.data.document_mask, sequence_sharded)
    kernel = (_attention_kernel(m.attention_kernel, m.kv_dim, compute, interpret, packages_here)
              if attention == "pallas" else "")
    experts = moe.n_experts > 0
    tp_ring = (cfg.parallel.tp_overlap == "collective_matmul" and degrees["tp"] > 1)
    pipeline = (PipelineRun(cfg.pipeline.schedule, degrees["pp"], cfg.pipeline.virtual_stages, cfg.train.grad_accum,
                            last_chunk_remat(cfg.pipeline.last_chunk_remat, cfg.train.remat))
                if pipelined else None)
    return Execution(
        backend=backend, attention=attention, attention_kernel=kernel, interpret=interpret,
        norm=_norm(m.norm, interpret, packages_here), loss=m.loss,
        cp_impl=cfg.parallel.cp_impl, cp_layout=cfg.parallel.cp_layout, sequence_sharded=sequence_sharded,
        tp_ring=tp_ring, moe_exchange=_moe_exchange(moe.dispatch) if experts else "",
        moe_gemm=_moe_gemm(moe.grouped_matmul, backend, interpret, packages_here) if experts else "",
        moe_fp32=experts and backend == "cpu" and compute != jnp.float32,
        fp8_cast=_fp8_cast(cfg.precision, interpret, packages_here),
        pipeline=pipeline, vocab_padded=padded_vocab(m, degrees["tp"]))


def resolve_for_mesh(cfg: Config, mesh) -> Execution:
    """resolve() for a built mesh: the backend is its devices' platform."""
    return resolve(cfg, dict(mesh.shape), mesh.devices.flat[0].platform)


def _attention(impl: str, backend: str, compute: jnp.dtype, document_mask: bool, sequence_sharded: bool) -> str:
    if impl != "auto":
        return impl
    if backend != "gpu" or compute not in FUSED_DTYPES:
        return "reference"
    # cuDNN measured fastest (docs/PERFORMANCE.md) but masks by index only: no segment ids, no split sequence.
    return "pallas" if document_mask or sequence_sharded else "cudnn"


def _attention_kernel(kernel: str, head_dim: int, compute: jnp.dtype, interpret: bool, packages_here: bool) -> str:
    if kernel == "triton":
        return _triton_installed(interpret, "model.attention_kernel=triton") if packages_here else "triton"
    why = pk.mosaic_unavailable(head_dim, compute, interpret=interpret)
    if kernel == "mosaic" and why:
        raise ConfigError(f"model.attention_kernel=mosaic: {why}; use model.attention_kernel=auto (Mosaic where it "
                          f"can run, Triton elsewhere) or triton")
    if not why:
        return "mosaic"
    return _triton_installed(interpret, f"model.attention=pallas ({why}, so its Triton kernels)") if packages_here \
        else "triton"


def _norm(norm: str, interpret: bool, packages_here: bool) -> str:
    """The fused RMSNorm (`pallas`) is written in Triton's language: refused here when its packages are not."""
    if norm == "pallas" and packages_here:
        _triton_installed(interpret, "model.norm=pallas")
    return norm


def _fp8_cast(precision, interpret: bool, packages_here: bool) -> str:
    """The per-tensor fp8 recipes' quantizer (fp8.CASTS): XLA's casts, or the Triton kernel, interpreted off a GPU."""
    if precision.matmul not in ("fp8", "fp8_delayed"):
        return ""
    if precision.fp8_cast == "triton" and packages_here:
        _triton_installed(interpret, "precision.fp8_cast=triton")
    return "interpret" if precision.fp8_cast == "triton" and interpret else precision.fp8_cast


def _triton_installed(interpret: bool, what: str) -> str:
    """"triton" when its packages are there (the interpreter needs triton; a GPU, jax-triton too), else the
    config error now, before any device work, not an import traceback inside the first step."""
    from meshtrain.config.run_checks import missing_package

    modules = ("triton",) if interpret else ("triton", "jax_triton")
    missing = [p for p in (missing_package(m, "triton", what) for m in modules) if p]
    if missing:
        raise ConfigError(missing)
    return "triton"


def _moe_exchange(dispatch: str) -> str:
    if dispatch == "auto":
        # Bytes per rank, over (ep - 1)·tokens·d_model: allgather 2, padded 2·top_k (parallel/expert.py).
        return "allgather"
    return dispatch


def _moe_gemm(gemm: str, backend: str, interpret: bool, packages_here: bool) -> str:
    """The gmm kernel ("pallas") is written in Triton's language: an explicit choice without its packages
    is the config error; auto on a GPU without them takes XLA's ragged_dot (a dense dot over the local
    experts: slower, but it runs), and off a GPU always (the kernel would run in Triton's interpreter,
    which is for tests)."""
    if gemm == "ragged_dot" or (gemm == "auto" and backend != "gpu"):
        return "ragged_dot"
    if not packages_here:
        return "pallas"
    try:
        _triton_installed(interpret, "moe.grouped_matmul=pallas")
    except ConfigError:
        if gemm == "pallas":
            raise
        return "ragged_dot"
    return "pallas"
