#!/usr/bin/env bash
# Run the numerics-sensitive test files under each CPU capability torch has, so that a test which
# holds only with one CPU's kernels (bf16 rounding, accumulation order, oneDNN's paths) shows up.
#
#     bash scripts/cpu_capabilities.sh                 # default, avx2, and avx512 where the CPU has it
#     bash scripts/cpu_capabilities.sh default         # only these capabilities (.ci/run does this)
#     FILES="tests/test_model.py" bash scripts/cpu_capabilities.sh avx2
#
# ATEN_CPU_CAPABILITY picks torch's own vectorised kernels; with avx2, ONEDNN_MAX_CPU_ISA=AVX2 also
# keeps oneDNN (bf16 matmuls among others) on an AVX2 CPU's path, as on most laptops and desktops.
set -euo pipefail
cd "$(dirname "$0")/.."

FILES=${FILES:-"tests/test_model.py tests/test_mixed_precision.py tests/test_recipe.py tests/test_sample.py tests/test_hf_interop.py"}
flags=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }

if [ $# -gt 0 ]; then
    caps=("$@")
else
    caps=(default)
    has avx2 && caps+=(avx2)
    has avx512f && has avx512bw && has avx512vl && has avx512dq && caps+=(avx512)
fi

failed=()
for cap in "${caps[@]}"; do
    isa=${ONEDNN_MAX_CPU_ISA:-ALL}
    [ "$cap" = avx2 ] && isa=AVX2
    echo "== ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=$isa: $FILES"
    # shellcheck disable=SC2086  # FILES is a list of paths
    if ! ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=$isa python -m pytest -q $FILES; then
        failed+=("$cap")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed under: ${failed[*]}" >&2
    exit 1
fi
echo "passed under: ${caps[*]}"
