"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""
import importlib.util
import os
import shutil
import tempfile

from helpers_env import CPU_COMPILE_FLAGS

# Must precede the first `import jax`: the CPU backend reads the device count once at start.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The suite compiles hundreds of small programs and runs each a few times: on a machine without a GPU,
# the CPU compiler's cheapest code generation (helpers_env.CPU_COMPILE_FLAGS) saves more than it costs.
if shutil.which("nvidia-smi") is None:
    os.environ["XLA_FLAGS"] += " " + CPU_COMPILE_FLAGS
# One compilation cache for the session, shared with the commands the tests start (they inherit the
# environment): many tests compile the same tiny step, in this process or in a fresh one.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshtrain-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def _has_triton_packages() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("triton", "jax_triton"))


# `-n auto --dist loadfile` hands each file whole to one worker, in collection order. Handing out the
# costliest files first (longest-first scheduling) keeps every worker busy to the end; in the order
# xdist would use by default (most tests first) the few heaviest files start last and one worker
# finishes them alone. Seconds each file took on 2 CPU cores, largest first; the rest follow in name order.
COSTLIEST_FILES_FIRST = (
    "test_pipeline.py",  # ~650 s (2026-11-27)
    "test_moe_equivalence.py",  # ~500
    "test_readme_commands.py",  # 433: 22 commands, one after the other
    "test_precision_model.py",  # ~360 (2026-11-27, with the fp8 weights quantized once)
    "test_context_parallel.py",  # 299
    "test_equivalence.py",  # 292
    "test_resume.py",  # 285
    "test_train_step.py",  # 240
    "test_slurm.py",  # 145-205 on a shared machine, + ~30 s of apt-get on a fresh one
    "test_pipeline_fp8.py",  # ~160-200 (fp8_delayed, and fp8 quantized once)
    "test_memory_grid.py",  # 170-200: 18 layouts compiled ahead of time
    "test_data_sources.py",  # ~130 (its 1,000-step resumed run: 108)
    "test_planning.py",  # 118
    "test_kernels_in_model.py",  # 116
    "test_optimizers.py",  # ~100
    "test_tracking.py",  # 75-115 on a shared machine
    "test_pipeline_moe_resume.py",  # ~80
    "test_scan_layout.py",  # ~70 (2026-11-28)
    "test_pipeline_documents.py",  # ~45
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order collection gives
        config.option.loadscopereorder = False


def _cost_rank(item) -> int:
    name = item.path.name
    return COSTLIEST_FILES_FIRST.index(name) if name in COSTLIEST_FILES_FIRST else len(COSTLIEST_FILES_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_cost_rank)  # stable: a file's tests keep their order
    if _has_gpu():
        if not _has_triton_packages():  # the `triton` extra is optional: its GPU tests skip, saying why
            skip_triton = pytest.mark.skip(reason="needs triton and jax-triton on the GPU: pip install -e '.[triton]'")
            for item in items:
                if item.get_closest_marker("triton"):
                    item.add_marker(skip_triton)
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
