#!/usr/bin/env bash
# Run the numerics-sensitive test files under each CPU capability torch has, so that a test which
# holds only with one CPU's kernels (bf16 rounding, accumulation order, oneDNN's paths) shows up.
#
#     bash scripts/cpu_capabilities.sh                 # default, avx2, and avx512 where the CPU has it
#     bash scripts/cpu_capabilities.sh default         # only these capabilities (.ci/run does this)
#     FILES="tests/test_model.py" bash scripts/cpu_capabilities.sh avx2
#
# ATEN_CPU_CAPABILITY picks torch's own vectorised kernels. Two more knobs must agree with it, or the
# mix is no real CPU: ONEDNN_MAX_CPU_ISA keeps oneDNN (bf16 and fp16 matmuls, CPU flash attention's
# packing) to that CPU's instructions, and TORCHINDUCTOR_CPP_MARCH the C++ that torch.compile builds
# (it compiles with -march=native otherwise). On a CPU with AVX-512 and AMX, default without the first
# failed in torch's fp16 attention ("pack_vnni2 is only supported when avx512 is supported"), and
# avx2 without the second trained a compiled model to a NaN loss at its first step.
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
x86=false
[ "$(uname -m)" = x86_64 ] && x86=true
for cap in "${caps[@]}"; do
    isa=${ONEDNN_MAX_CPU_ISA:-ALL}
    march=${TORCHINDUCTOR_CPP_MARCH:-}
    if $x86; then
        case "$cap" in  # the oldest x86-64 (SSE4.1, oneDNN's floor), and Haswell's level (AVX2, FMA)
            default) isa=SSE41 march=x86-64 ;;
            avx2) isa=AVX2 march=x86-64-v3 ;;
        esac
    fi
    vars=(ATEN_CPU_CAPABILITY="$cap" ONEDNN_MAX_CPU_ISA="$isa")
    [ -n "$march" ] && vars+=(TORCHINDUCTOR_CPP_MARCH="$march")  # set but empty, it would mean no -march at all
    echo "== ${vars[*]}: $FILES"
    # shellcheck disable=SC2086  # FILES is a list of paths
    if ! env "${vars[@]}" python -m pytest -q $FILES; then
        failed+=("$cap")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed under: ${failed[*]}" >&2
    exit 1
fi
echo "passed under: ${caps[*]}"
