"""Environment settings the test process and the commands it starts share (imported before jax)."""

# Skip LLVM's expensive optimization passes on the CPU backend: the tests' programs are small and run a few
# times, so compiling them fast matters more than the code's speed. (The lowest optimization level,
# --xla_backend_optimization_level=0, compiles faster still but rounds differently enough that a 4-step fp32
# trajectory on 8 devices leaves rtol 1e-5 of the same on one device.)
CPU_COMPILE_FLAGS = "--xla_llvm_disable_expensive_passes=true"
