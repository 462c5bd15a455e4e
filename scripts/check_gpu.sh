#!/usr/bin/env bash
# The GPU half of the checks, on a machine with the GPU: the GPU test suite, then
# compute-sanitizer memcheck / racecheck / synccheck on the kernels' small test problems.
usage() {
  cat <<'EOF'
Usage: bash scripts/check_gpu.sh [OUTDIR]
  Runs the GPU test suite, then compute-sanitizer memcheck / racecheck / synccheck on the
  kernels' small test problems, from the repository root. Writes OUTDIR/pytest_gpu.log and
  OUTDIR/sanitizer.txt (OUTDIR: results by default) and prints both.
  Exit status 0 only when the suite ran GPU tests and passed, and every sanitizer section ran
  tests that passed with 0 sanitizer errors (scripts/check_gpu_verdict.py names any that did
  not); 1 when no GPU is visible (said before anything runs) or a check failed; 2 on bad
  arguments. PYTHON names the interpreter (default: python).
EOF
}
set -u
case "${1-}" in
  -h|--help) usage; exit 0 ;;
  -*) echo "check_gpu.sh: unknown option '$1' (OUTDIR may not start with '-'; --help for usage)" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then
  echo "check_gpu.sh: expected at most one argument, OUTDIR; got $# ($*)" >&2
  exit 2
fi
out=${1:-results}
py=${PYTHON:-python}
here=$(cd "$(dirname "$0")" && pwd)

# Without a GPU every GPU test skips and the sanitizers have nothing to run: a run would pass
# having checked nothing, so the missing GPU is an error, said before anything runs.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "check_gpu.sh: no GPU visible: nvidia-smi not found (no NVIDIA driver on this machine)" >&2
  exit 1
fi
if ! gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1) || [ -z "$gpu" ]; then
  echo "check_gpu.sh: no GPU visible: nvidia-smi failed: $(echo "$gpu" | head -1)" >&2
  exit 1
fi
"$py" - <<'EOF' || exit 1
import sys
try:
    from lab.gpu import GPUUnavailable, require_gpu
except ImportError as exc:
    sys.exit(f"check_gpu.sh: cannot import lab (run from the repository root): {exc}")
try:
    require_gpu("the GPU suite")
except GPUUnavailable as exc:
    sys.exit(f"check_gpu.sh: no GPU visible to CuPy: {exc}")
EOF
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ ! -x "$san" ]; then
  echo "check_gpu.sh: compute-sanitizer not found (neither on PATH nor at $san)" >&2
  exit 1
fi

mkdir -p -- "$out" || exit 1
"$py" -m pytest -q -m gpu tests/ 2>&1 | tail -20 > "$out/pytest_gpu.log"
status=${PIPESTATUS[0]}
{
  echo "compute-sanitizer on $(echo "$gpu" | head -1), kernels of ${LAB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}:"
  echo "  grouped_gemm: tests/test_grouped_gemm.py -k 'one_expert or subnormal or two_problems'"
  echo "  fused: tests/test_fused.py -k 'fixed or non_finite or register_swiglu'"
  echo "  w4a16: tests/test_gemm_w4a16.py -k 'deterministic or subnormal or bit_for_bit'"
  echo "  large tiles: tests/test_gemm_large_tiles.py -k float64"
  echo "  activation image: tests/test_gemm_image.py -k 'layout or float64 or bf16_as'"
  echo "  swiglu_quant: tests/test_swiglu_quant.py"
  echo "  w4a8: tests/test_w4a8_gemm.py (the W4A8 GEMMs: register and shared-memory A, resident activations, the activation image, the SwiGLU epilogue, the one-launch layer; the 1x128 fp8 quantize)"
  run() {  # tool, name, pytest arguments...
    local tool=$1 name=$2; shift 2
    echo "== $tool $name"
    # the summary line whatever it counts (a run that skipped everything says only "skipped")
    "$san" --tool "$tool" "$py" -m pytest -q "$@" 2>&1 \
      | grep -E "passed|failed|error|skipped|deselected|no tests ran|SUMMARY|^FAILED" | tail -6
  }
  for tool in memcheck racecheck synccheck; do
    run "$tool" grouped_gemm tests/test_grouped_gemm.py -k 'one_expert or subnormal or two_problems'
    run "$tool" fused tests/test_fused.py -k 'fixed or non_finite or register_swiglu'
    run "$tool" w4a16 tests/test_gemm_w4a16.py -k 'deterministic or subnormal or bit_for_bit'
    run "$tool" large_tiles tests/test_gemm_large_tiles.py -k float64
    run "$tool" image tests/test_gemm_image.py -k 'layout or float64 or bf16_as'
    run "$tool" w4a8 tests/test_w4a8_gemm.py
  done
  run memcheck swiglu_quant tests/test_swiglu_quant.py
  echo "GPU suite in the same call: $(tail -1 "$out/pytest_gpu.log")"
} > "$out/sanitizer.txt"
cat "$out/pytest_gpu.log" "$out/sanitizer.txt"
"$py" "$here/check_gpu_verdict.py" "$out"
verdict=$?
if [ "$status" -ne 0 ]; then
  exit "$status"
fi
exit "$verdict"
