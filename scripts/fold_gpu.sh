#!/usr/bin/env bash
# The ESMFold2 benchmarks on a lent GPU machine, one step a call (each under 10 minutes), in
# priority order:
#
#   bash scripts/fold_gpu.sh fast-mlx       # ESMFold2-Fast shape, L = 256 and 512: mlx, mlx-affine4, mlx-mxfp4
#   bash scripts/fold_gpu.sh fast-torch     # the same folds in transformers, eager (bf16 autocast)
#   bash scripts/fold_gpu.sh fast-compile   # transformers with regional torch.compile, beside mlx
#   bash scripts/fold_gpu.sh memory         # MLX peak memory, 4-bit backbone, L = 512 and 1,024
#   bash scripts/fold_gpu.sh stages         # each MLX fold's stages, bf16 and 4-bit: seconds and peak
#   bash scripts/fold_gpu.sh full           # ESMFold2 shape (48 blocks, MSA encoder), L = 256 and 512: mlx, affine4, eager
#   bash scripts/fold_gpu.sh validate       # esmc-convert --q 4, then esmc-mlx validate, of a random 6B checkpoint
#   bash scripts/fold_gpu.sh fidelity       # the same unquantized in float32: MLX against transformers on fold_fidelity_floor's weights
#
# Several names run one after the other in one call (`bash scripts/fold_gpu.sh fast-mlx memory`);
# each step is bounded by `timeout` and a failed one does not stop the next. Assumes the machine is
# set up (docs: /work/shared/GPU.md, scripts/device_setup.py): PYTHONPATH holding MLX's CUDA wheel
# and this checkout, python3 with torch (CUDA) and transformers with `models.esmfold2`. Writes
# $OUT/<step>/ (JSON, per-side rows) and $OUT/<step>.log.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/fold-gpu}
LIMIT=${LIMIT:-570}  # seconds a step may run: under a call's 10 minutes
export PYTHONUNBUFFERED=1
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$HOME/.cache/esmc-mlx-ptx}  # kernels compiled once per machine
mkdir -p "$OUT"

step() {  # step NAME ARGS...: python3 ARGS under the time limit, its output in $OUT/NAME.log
    local name=$1
    shift
    mkdir -p "$OUT/$name"
    echo "== $name: $*" | tee "$OUT/$name.log"
    timeout --kill-after=15 "$LIMIT" python3 "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc$([ "$rc" = 124 ] && echo " (stopped at ${LIMIT} s)")" | tee -a "$OUT/$name.log"
}

speed() {  # speed NAME SIDE-TIMEOUT ARGS...
    local name=$1 side_timeout=$2
    shift 2
    step "$name" -m benchmarks.fold_speed --device gpu --side-timeout "$side_timeout" --out "$OUT/$name" "$@"
}

python3 -c "import mlx.core as mx, torch; print(mx.default_device(), torch.cuda.get_device_name())" | tee "$OUT/device.log"
for name in "${@:-fast-mlx}"; do
    case $name in
        fast-mlx) speed fast-mlx 180 --sides mlx,mlx-affine4,mlx-mxfp4 --full-lengths ;;
        fast-torch) speed fast-torch 540 --sides torch-eager --full-lengths ;;
        fast-compile) speed fast-compile 300 --sides mlx,torch-compile --full-lengths --warmup 2 --reps 2 ;;
        memory) speed memory 540 --memory --memory-lengths 512 1024 --steps 8 --loops 1 ;;
        stages) speed stages 240 --sides mlx,mlx-affine4 --full-lengths --reps 1 --stages ;;
        full) speed full 240 --sides mlx,mlx-affine4,torch-eager --lengths --full-lengths 256 512 --reps 2 ;;
        validate) step validate -m benchmarks.fold_validate_speed --device gpu --out "$OUT/validate" ;;
        fidelity) step fidelity -m benchmarks.fold_validate_speed --device gpu --dtype float32 --q none --out "$OUT/fidelity" ;;
        dry-run) step dry-run -m benchmarks.fold_speed --dry-run --device gpu ;;
        *) echo "unknown step $name (fast-mlx fast-torch fast-compile memory stages full validate fidelity dry-run)" ;;
    esac
done
