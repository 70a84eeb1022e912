"""Shared test helpers: a tiny fp32 config and a function that trains it on a given mesh."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from helpers_env import CPU_COMPILE_FLAGS
from meshtrain.config import MESH_AXES, Config, build_config, validate, with_mesh
from meshtrain.mesh import build_mesh
from meshtrain.step.accumulate import make_grad_fn
from meshtrain.step.state import Setup, build_setup, init_state, make_batches
from meshtrain.step.train_step import make_train_step

# Small enough for 2 CPU cores, shaped so that every axis can split: 4 query heads and 2 kv heads
# (so tp=4 replicates kv heads and tp=2 splits them), d_model 64 over fsdp=8, vocab 128 over tp=4.
TINY = [
    "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
    "model.vocab_size=128", "data.seq_len=16", "train.global_batch=16", "precision.compute=float32",
    "train.lr=1e-2", "train.warmup_steps=2", "train.steps=5", "run.progress=false",
]


def tiny_config(*overrides: str) -> Config:
    return build_config({}, TINY + list(overrides))


def make_setup(cfg: Config, n_devices: int) -> Setup:
    degrees = validate(cfg, n_devices)
    return build_setup(with_mesh(cfg, degrees), build_mesh(degrees, jax.devices()[:n_devices]))


def single_device(cfg: Config) -> Config:
    """The same config on one device: every mesh degree 1."""
    return build_config(cfg.to_dict() | {"mesh": {a: 1 for a in MESH_AXES}}, [])


def train_losses(setup: Setup, n_steps: int) -> list[float]:
    batches = make_batches(setup)
    state, step = init_state(setup), make_train_step(setup)
    losses = []
    for i in range(n_steps):
        state, m = step(state, batches.batch(i))
        losses.append(float(m["loss"]))
    return losses


def flatten(tree: dict, prefix: str = "") -> dict:
    """{'a': {'b': x}} -> {'a/b': x}"""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


def assert_grads_close(got: dict, want: dict) -> None:
    """Gradients equal to 1e-5 of each tensor's largest entry (fp32, reductions reordered by sharding)."""
    flat_got, flat_want = flatten(got), flatten(want)
    assert flat_got.keys() == flat_want.keys()
    for name, w in flat_want.items():
        scale = float(np.max(np.abs(w)))
        assert scale > 0, f"{name}: reference gradient is all zeros; the comparison would prove nothing"
        np.testing.assert_allclose(flat_got[name], w, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def model_order_grad_fn(setup: Setup):
    """make_grad_fn(setup), jitted, taking and giving the layer stacks in the model's order: the state keeps them in
    `setup.layers_order` (the pipeline stages' under interleaved and dualpipe_v), a one-device reference in the
    model's, and the comparison must not depend on it."""
    grad_fn = make_grad_fn(setup)

    def in_model_order(params, batch, scale=1.0, model_state=None):
        out = grad_fn(setup.to_stored_order(params), batch, scale, setup.to_stored_order(model_state or {}))
        return out._replace(grads=setup.to_model_order(out.grads), model_state=setup.to_model_order(out.model_state))

    return jax.jit(in_model_order)


def first_gradients(setup: Setup) -> dict:
    """Mean-over-tokens gradient at the initial parameters, on the first batch, as numpy, in the model's order."""
    batches = make_batches(setup)
    state = init_state(setup)
    grads, _, n, _, _ = jax.jit(make_grad_fn(setup))(state.params, batches.batch(0), 1.0, state.model_state)
    return jax.tree.map(lambda g: np.asarray(g) / float(n), jax.jit(setup.to_model_order)(grads))


# ------------------------------------------------------------------------------- subprocess runs

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

CLI_TINY = TINY + ["train.log_every=1"]


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for a fresh `python -m meshtrain.run`: CPU only, the device count left to run.py, the
    suite's fast CPU compilation (helpers_env)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=CPU_COMPILE_FLAGS, **extra)
    return env


def run_cli(*overrides: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "meshtrain.run", *CLI_TINY, *overrides], env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"meshtrain.run failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def logged_losses(run_dir: str | Path, key: str = "loss") -> dict[int, float]:
    """step -> loss (or another logged `key`, e.g. "eval_loss") from metrics.jsonl (JSON keeps Python floats exactly,
    so equality is bitwise). Train records carry loss, eval records eval_loss."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if key in rec:
            out[rec["step"]] = rec[key]
    return out


# ------------------------------------------------------------------------- Hugging Face fixtures

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def hf_tensors_of(directory: Path) -> dict:
    """Every tensor of a Hugging Face directory (one file or several), as numpy."""
    from safetensors.numpy import load_file
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def all_eqns(jaxpr):
    """Every equation of a jaxpr, those of inner jaxprs (scan, remat, custom_vjp, pjit bodies) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else (v,):
                inner = j if hasattr(j, "eqns") else getattr(j, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def packed_segment_ids(b: int, t: int, lengths) -> jax.Array:
    """[b, t] int32 segment ids of packed documents: the given lengths in turn (each row starting one
    document further along), the last one cut at t."""
    ids = np.zeros((b, t), np.int32)
    for row in range(b):
        pos, doc = 0, 0
        while pos < t:
            n = lengths[(doc + row) % len(lengths)]
            ids[row, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return jnp.asarray(ids)


def assert_grad_prints_no_deprecation(loss, args, capfd) -> None:
    """The gradient of `loss(*args)` in every argument neither raises a DeprecationWarning nor prints one:
    jax 0.11 warns at every call of a Pallas kernel lowered through Triton, and the kernels checked with this
    go through jax-triton or Mosaic GPU instead."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.block_until_ready(jax.grad(loss, tuple(range(len(args))))(*args))
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)], [str(w.message) for w in caught]
    assert "deprecat" not in capfd.readouterr().err.lower()


def assert_attention_grad_prints_no_deprecation(attention, capfd) -> None:
    """assert_grad_prints_no_deprecation for `attention(q, k, v)` on a small causal GQA case in bf16."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    q, k, v, do = (normal(key, shape) for key, shape in
                   zip(keys, [(1, 256, 4, 128), (1, 256, 2, 128), (1, 256, 2, 128), (1, 256, 4, 128)]))
    loss = lambda q, k, v: jnp.vdot(attention(q, k, v).astype(jnp.float32), do.astype(jnp.float32))  # noqa: E731
    assert_grad_prints_no_deprecation(loss, (q, k, v), capfd)


# ------------------------------------------------------------- Triton kernels compiled for an H100

# Runs in a fresh process: Triton's interpreter, which the kernels' CPU tests turn on, is a mode of the whole
# process. jax-triton's `triton_call` is stubbed by one that compiles the kernel for an H100 (sm_90, down to
# a cubin: Triton ships its own LLVM and ptxas) with the signature and constexprs the launcher hands it.
_COMPILE_FOR_SM90 = """
import sys, types
import jax, jax.numpy as jnp, triton
from triton.backends.compiler import GPUTarget

TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32"}
compiled = []

def triton_call(*args, kernel, out_shape, grid, name, num_warps, num_stages, **constexprs):
    signature = {a: "*" + TRITON_TYPES[str(x.dtype)] for a, x in zip(kernel.arg_names, [*args, *out_shape])}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    src = triton.compiler.ASTSource(kernel, signature,
                                    constexprs={(kernel.arg_names.index(a),): v for a, v in constexprs.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    compiled.append(name)
    return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

sys.modules["jax_triton"] = types.SimpleNamespace(triton_call=triton_call)
"""


def compile_for_sm90(body: str, dtype: str) -> list[str]:
    """Run `body` after a prelude that stubs jax-triton's `triton_call` by Triton's compiler for sm_90, in a
    fresh CPU-only process (no TRITON_INTERPRET) with `dtype` as sys.argv[1]; `body` lowers the kernels'
    compiled path (interpret=False) and ends with `print("compiled:", *compiled)`. Returns the names of the
    kernels compiled, in order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90 + body, dtype], cwd=Path(__file__).parents[1],
                          env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    words = proc.stdout.split()
    assert words[:1] == ["compiled:"], proc.stdout
    return words[1:]


def rel_l2(a, b) -> float:
    """Relative L2 error of a against b, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30))


def loss_and_vjp(fn, h, w, labels, cotangent):
    """(fn(h, w, labels), its vjp in h and w for `cotangent`), jitted: a kernel and its reference compared alike."""
    def f(h, w):
        loss, vjp = jax.vjp(lambda h, w: fn(h, w, labels), h, w)
        return (loss,) + vjp(cotangent)
    return jax.jit(f)(h, w)
