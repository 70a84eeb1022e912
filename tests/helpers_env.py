"""Environment settings the test process and the commands it starts share (imported before jax)."""

# LLVM's lowest optimization level for the CPU backend: the tests' programs are small and run a few times,
# so compiling them fast matters more than the code's speed (about 10% of the suite's time).
CPU_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
