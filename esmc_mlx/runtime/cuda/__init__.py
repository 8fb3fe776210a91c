"""The CUDA side of the runtime: this project's kernels (CUDA text in the .cu/.cuh files beside
this), their compiled forms kept on disk, CUTLASS's GEMM, and the fused forward steps a CUDA
GPU's model runs (fusions.py). Which of them runs for a call is runtime/dispatch.py's decision."""
