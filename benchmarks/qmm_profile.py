"""One call of the fused quantized matmul (kernels.quantized_matmul) and one of cuBLAS's bf16
GEMM per weight and token count, for Nsight Compute to profile on a CUDA GPU: the 6B's gate/up
and qkv weights, mxfp4 (groups of 32). Each call is evaluated on its own, so each is one kernel
launch (with K split, a second for the slabs' sum).

    ncu --clock-control none --kernel-name regex:"esmc_qmm|nvjet|gemm" \\
        --section SpeedOfLight --section Occupancy --section SchedulerStats \\
        --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        python -m benchmarks.qmm_profile --tiles wg --rows 256,1024 > ncu.txt
"""

import argparse

import mlx.core as mx

from esmc_mlx.runtime import kernels

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--tiles", default="wg", help="warp tiles, each called once per shape (kernels.qmm_tile's names)")
p.add_argument("--rows", default="256,1024", help="token counts")
a = p.parse_args()
mx.random.seed(0)
for n, k in ((13824, 2560), (7680, 2560)):
    wf = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
    wq, scales = mx.quantize(wf, group_size=32, bits=4, mode="mxfp4")
    mx.eval(wf, wq, scales)
    for rows in map(int, a.rows.split(",")):
        x = mx.random.normal((rows, k)).astype(mx.bfloat16)
        mx.eval(x)
        for tile in a.tiles.split(","):
            mx.eval(kernels.quantized_matmul(x, wq, scales, None, 32, 4, "mxfp4", tile=tile))
        mx.eval(x @ wf.T)
