#!/usr/bin/env bash
# The GPU half of the checks, on a machine with the GPU: the GPU test suite, then
# compute-sanitizer memcheck / racecheck / synccheck on the kernels' small test problems.
# Usage: bash scripts/check_gpu.sh [OUTDIR]   (writes pytest_gpu.log and sanitizer.txt there)
set -u
out=${1:-results}
mkdir -p "$out"
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
python -m pytest -q -m gpu tests/ 2>&1 | tail -20 > "$out/pytest_gpu.log"
status=${PIPESTATUS[0]}
{
  echo "compute-sanitizer on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), kernels of ${LAB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}:"
  echo "  grouped_gemm: tests/test_grouped_gemm.py -k 'one_expert or subnormal or two_problems'"
  echo "  fused: tests/test_fused.py -k 'fixed or non_finite or register_swiglu'"
  echo "  w4a16: tests/test_gemm_w4a16.py -k 'deterministic or subnormal or bit_for_bit'"
  echo "  large tiles: tests/test_gemm_large_tiles.py -k float64"
  echo "  activation image: tests/test_gemm_image.py -k 'layout or float64 or bf16_as'"
  echo "  swiglu_quant: tests/test_swiglu_quant.py"
  run() {  # tool, name, pytest arguments...
    local tool=$1 name=$2; shift 2
    echo "== $tool $name"
    "$san" --tool "$tool" python -m pytest -q "$@" 2>&1 | grep -E "passed|failed|error|SUMMARY|^FAILED" | tail -6
  }
  for tool in memcheck racecheck synccheck; do
    run "$tool" grouped_gemm tests/test_grouped_gemm.py -k 'one_expert or subnormal or two_problems'
    run "$tool" fused tests/test_fused.py -k 'fixed or non_finite or register_swiglu'
    run "$tool" w4a16 tests/test_gemm_w4a16.py -k 'deterministic or subnormal or bit_for_bit'
    run "$tool" large_tiles tests/test_gemm_large_tiles.py -k float64
    run "$tool" image tests/test_gemm_image.py -k 'layout or float64 or bf16_as'
  done
  run memcheck swiglu_quant tests/test_swiglu_quant.py
  echo "GPU suite in the same call: $(tail -1 "$out/pytest_gpu.log")"
} > "$out/sanitizer.txt"
cat "$out/pytest_gpu.log" "$out/sanitizer.txt"
exit "$status"
