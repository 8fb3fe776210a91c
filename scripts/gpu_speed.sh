#!/usr/bin/env bash
# The GPU speed record: esmc-mlx bench against eager and compiled transformers, LoRA training
# against torch + peft (with the runs that tell a host-bound step from a GPU-bound one), the
# float model's fused-step plans A/B, each compared with the recorded run in docs/bench. JSON
# and a log go to $OUT; each part fits one device call (10 minutes).
#
# Here, first (the device's copy of the tree has no git; .whl/ and SOURCE_COMMIT are ignored):
#   .venv/bin/python scripts/device_setup.py prepare          # MLX's CUDA wheel in parts, CUTLASS
#   .venv/bin/pip download --no-deps -d .whl/py mlx-lm==0.32.2 peft==0.21.2 accelerate
#   .venv/bin/python -m benchmarks.compare --stamp            # SOURCE_COMMIT: the commit benchmarks record
# On the machine, after device_setup.py's stash calls and its install, back to back while warm
# (carry .whl/c, .whl/cache, .whl/py and SOURCE_COMMIT):
#   bash scripts/gpu_speed.sh forward     # the 6B: bf16 and its quantized twins; torch eager, compiled
#   bash scripts/gpu_speed.sh train       # the 300M's bench, LoRA training, the plan A/B
set -uo pipefail
part=${1:?"which part: forward or train"}
: "${OUT:?set OUT to the folder for the results}"
export PYTHONPATH="$HOME/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" ESMC_MLX_CACHE="${ESMC_MLX_CACHE:-$HOME/cache}"
export PYTHONUNBUFFERED=1
log="$OUT/$part.log"
exec > >(tee "$log") 2>&1

python3 -c "import mlx_lm, peft" 2>/dev/null || {
  ls .whl/py/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target "$HOME/site" .whl/py/*.whl
}
python3 -c "import mlx.core as mx; assert mx.default_device() == mx.gpu, 'MLX is not on the GPU'; print(mx.__version__, mx.device_info()['device_name'])" || exit 1
[ -f SOURCE_COMMIT ] && echo "source: $(cat SOURCE_COMMIT)" || echo "note: no SOURCE_COMMIT: the JSON will record no commit"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
work=$(mktemp -d)

compare() {  # new recorded
  echo "== compare $1 with $2"
  python3 -m benchmarks.compare "$1" "$2" || true
}

case "$part" in
forward)
  python3 -m esmc_mlx.cli bench --model 6B --shapes 1x256,1x1024,16x256,64x512 --torch eager,compiled \
    --quant mxfp4 --quant affine4 --quant affine8 -o "$work/6b" && cp "$work/6b/bench.json" "$OUT/bench_6b.json"
  compare "$OUT/bench_6b.json" docs/bench/bench_6b_h200.json
  ;;
train)
  python3 -m esmc_mlx.cli bench --model 300M --shapes 1x256,1x1024,16x256,64x512 --torch eager,compiled \
    -o "$work/300m" && cp "$work/300m/bench.json" "$OUT/bench_300m.json"
  compare "$OUT/bench_300m.json" docs/bench/bench_300m_h200.json
  ft() { python3 -m benchmarks.finetune_speed --model 300M --dtype bfloat16 --shape 16x256 "$@"; }
  ft --out "$work/ft" && cp "$work/ft/finetune_speed.json" "$OUT/finetune_speed.json"
  compare "$OUT/finetune_speed.json" docs/bench/finetune_speed_h200.json
  # MLX alone, one process each: the shipped limit, MLX's own limit, a larger CUDA-graph cache,
  # no CUDA graphs, the shipped limit again (the drift between the first and the last)
  ab() {  # NAME [VAR=VALUE ...] [-- OPTIONS]
    local name=$1 vars=() opts=()
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do vars+=("$1"); shift; done
    [ $# -gt 0 ] && shift && opts=("$@")
    env "${vars[@]}" python3 -m benchmarks.finetune_speed --model 300M --dtype bfloat16 --shape 16x256 --no-torch \
      "${opts[@]}" --out "$work/ab-$name" && cp "$work/ab-$name/finetune_speed.json" "$work/ab-$name.json"
  }
  ab 1-shipped
  ab 2-mlx-limit -- --memory-limit mlx
  ab 3-graph-cache-4000 MLX_CUDA_GRAPH_CACHE_SIZE=4000
  ab 4-no-cuda-graphs MLX_USE_CUDA_GRAPHS=0
  ab 5-shipped-again
  python3 - "$work" "$OUT/finetune_ab.json" <<'EOF'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
runs = {p.stem[3:]: json.loads(p.read_text()) for p in sorted(work.glob("ab-*.json"))}
out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
for name, r in runs.items():
    m = r["mlx"]
    print(f"{name:>18}: {m['median_s'] * 1e3:7.1f} ms a step (min {m['min_s'] * 1e3:.1f}), queued after "
          f"{m['host_median_s'] * 1e3:.1f} ms, peak {m['peak_memory_gb']:.2f} GB, limit {m['memory_limit_gb']:.0f} GB")
EOF
  python3 -m benchmarks.paths_ab --model 6B --modes float --shapes 1x256,1x1024,16x256,64x512 \
    --sides shipped,add_norm_from=2097152,add_norm_from=0 --json "$OUT/paths_ab_float_6b.json"
  python3 -m benchmarks.paths_ab --model 300M --modes float --shapes 1x256,1x1024,16x256,64x512 \
    --sides shipped,add_norm_from=2097152,add_norm_from=0 --json "$OUT/paths_ab_float_300m.json"
  ;;
*)
  echo "unknown part $part: forward or train"
  exit 2
  ;;
esac
rm -rf "$work"
