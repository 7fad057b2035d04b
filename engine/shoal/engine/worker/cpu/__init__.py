"""The CPU backend: what the engine adds on a CPU to transformers' own model code.

- backend.py: CpuBackend, the one hook the model runner calls (prepare the loaded model, make
  the fused ops active around its forwards, load the decode kernel), and the logs that say which
  path each part took.
- linear.py: float32 (and native-bf16) nn.Linear -> oneDNN's packed linear, packed at load.
- fused.py + fused_ops.c: RMSNorm, SiLU-gated MLP, rotate-half RoPE and argmax in one pass each.
- decode_kernel.py + paged_decode.c: the paged-decode attention kernel.
- c_build.py: builds and loads the C files (and bf16.h beside them) into `$SHOAL_CACHE/kernels`.
- cpus.py: the CPUs this process may use, its torch threads, OpenMP's wait policy (torch-free:
  read before torch loads).

This package's import is cheap and torch-free; its modules are imported by name.
"""
