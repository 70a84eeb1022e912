"""The XLA flags a config sets before jax starts (meshtrain/xla_flags.py)."""
from meshtrain import xla_flags
from meshtrain.config import load_config

TP_FLAGS = set(xla_flags.TP_OVERLAP_GPU_FLAGS)


def flags(*overrides) -> list[str]:
    env = {}
    xla_flags.apply_config(load_config(None, list(overrides)), env)
    return env.get("XLA_FLAGS", "").split()


NO_FSDP = ("mesh.fsdp=1",)
COMBINE_128 = ["--xla_gpu_all_gather_combine_threshold_bytes=134217728",
               "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728"]


def test_default_config_combines_fsdp_collectives():
    assert flags() == COMBINE_128  # the default mesh.fsdp=-1 may be > 1
    assert flags("mesh.fsdp=2", "parallel.fsdp_combine_mib=512")[0].endswith(f"={512 << 20}")
    assert flags("parallel.fsdp_combine_mib=0") == [] and flags(*NO_FSDP) == []


def test_negative_combine_size_is_a_config_error(capsys):
    from meshtrain.run import main
    assert main(["parallel.fsdp_combine_mib=-1"]) == 2
    err = capsys.readouterr().err
    assert "parallel.fsdp_combine_mib=-1" in err and ">= 0" in err


def test_fp8_turns_triton_gemms_off():
    assert flags(*NO_FSDP, "precision.matmul=fp8_delayed") == list(xla_flags.FP8_GPU_FLAGS)


def test_tp_overlap_only_with_tensor_parallelism():
    assert set(flags("mesh.fsdp=1", "mesh.tp=2", "parallel.tp_overlap=windowed_einsum")) == TP_FLAGS
    assert set(flags("mesh.fsdp=1", "mesh.tp=-1", "parallel.tp_overlap=windowed_einsum")) == TP_FLAGS  # the rest: may be > 1
    assert flags(*NO_FSDP, "mesh.tp=1", "parallel.tp_overlap=windowed_einsum") == []  # fsdp's gathers are left to the scheduler
    assert flags("mesh.fsdp=1", "mesh.tp=2") == []


def test_a_flag_the_user_set_wins():
    env = {"XLA_FLAGS": "--xla_gpu_threshold_for_windowed_einsum_mib=64"}
    added = xla_flags.apply(xla_flags.TP_OVERLAP_GPU_FLAGS, env)
    assert "--xla_gpu_threshold_for_windowed_einsum_mib=0" not in added and len(added) == 2
    assert env["XLA_FLAGS"].split()[0] == "--xla_gpu_threshold_for_windowed_einsum_mib=64"


def test_unknown_overlap_is_a_config_error(capsys):
    from meshtrain.run import main
    assert main(["parallel.tp_overlap=ring"]) == 2
    err = capsys.readouterr().err
    assert "parallel.tp_overlap" in err and "windowed_einsum" in err


def test_gpu_memory_fraction_is_set_before_jax_unless_the_environment_has_one():
    env = {}
    xla_flags.apply_config(load_config(None, ["run.gpu_memory_fraction=0.95"]), env)
    assert env[xla_flags.MEM_FRACTION_VAR] == "0.95" and xla_flags.gpu_memory_fraction(env) == 0.95
    env = {xla_flags.MEM_FRACTION_VAR: ".8"}  # the user's own setting wins
    xla_flags.apply_config(load_config(None, ["run.gpu_memory_fraction=0.95"]), env)
    assert env[xla_flags.MEM_FRACTION_VAR] == ".8"
    env = {}
    xla_flags.apply_config(load_config(None, []), env)  # 0: jax's default
    assert xla_flags.MEM_FRACTION_VAR not in env and xla_flags.gpu_memory_fraction(env) == 0.75


def test_gpu_memory_fraction_out_of_range_is_a_config_error(capsys):
    from meshtrain.run import main
    assert main(["run.gpu_memory_fraction=1.5"]) == 2
    err = capsys.readouterr().err
    assert "run.gpu_memory_fraction=1.5" in err and "(0, 1]" in err
