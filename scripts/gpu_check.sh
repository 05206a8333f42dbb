#!/usr/bin/env bash
# The whole GPU check, one command: the gpu-marked tests, then bench.py's GPT-2 preset on CUDA.
#
#     bash scripts/gpu_check.sh OUT_DIR                 # on a CUDA machine: about 8 min on one H200;
#                                                       # each step has a hard cap (250 + 150 + 110 + 60 s < 10 min)
#     bash scripts/gpu_check.sh OUT_DIR --cpu-dry-run   # the same steps on the CPU at tiny sizes (~3 min):
#                                                       # checks the plumbing; the gpu tests skip
#
# Everything goes to OUT_DIR: environment.txt (GPU, driver, torch), pytest_gpu.txt, bench_gpt2.txt/.json
# (training tokens/s and MFU eager and compiled, Muon's step, attention memory up to T = 16384, GPT-2-small
# decoding at batch 1 with and without the KV cache), bench_loop.txt/.json (train.py's iteration against a
# plain loop), bench_gpt2_decode_b8.txt/.json (decoding at batch 8), and summary.txt (each step's exit status
# and time): 8 files.
# Offline: no network and no ../shared needed. GPT-2's BPE (only bench's prepare section uses it, and it
# is not run here) is read from .cache/tiktoken when that folder exists (git-ignored; copy it with
# `mkdir -p .cache && cp -r ../shared/tiktoken_cache .cache/tiktoken`).
set -uo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUT_DIR [--cpu-dry-run]}
dry=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
[ -d .cache/tiktoken ] && export TIKTOKEN_CACHE_DIR=$PWD/.cache/tiktoken
summary=$out/summary.txt
: > "$summary"

step() {  # step NAME TIMEOUT_S COMMAND...: run it, keep its output, record its status; go on either way
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "== $name: $*" | tee -a "$summary"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    echo "   exit $rc after $((SECONDS - t0)) s" | tee -a "$summary"
    tail -n 5 "$out/$name.txt"
}

if [ "$dry" = "--cpu-dry-run" ]; then
    device=(--device=cpu --dtype=float32 --threads=1)
    # tiny sizes; anything given on the command line overrides the preset
    tiny=(--batch_size=2 --block_size=64 --n_layer=1 --n_head=2 --n_embd=64 --vocab_size=512 --repeats=1 --warmup=1
          --loop_config=config/train_shakespeare_char_cpu.py --loop_steps=2 --attn_n_head=2 --attn_lengths=256,512
          --attn_repeats=1 --decode_n_layer=1 --decode_n_head=2 --decode_n_embd=64 --decode_block_size=128
          --decode_vocab_size=512 --decode_contexts=32,128 --gen_new_tokens=40 --compile=False --muon_shape=n_layer=1)
else
    device=(--device=cuda)
    tiny=()
fi

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt" | tail -n 2

step pytest_gpu 250 python -m pytest -m gpu -v -rA -p no:cacheprovider --continue-on-collection-errors
# muon: torch.optim.Muon against BatchedMuon (what every device gets) on GPT-2 small's 48 hidden matrices
step bench_gpt2 150 python bench.py --preset=gpt2 "${device[@]}" --sections=train,muon,attention,decode \
    --muon_shape=n_layer=12,n_head=12,n_embd=768 --gen_repeats=1 --out="$out/bench_gpt2.json" "${tiny[@]}"
# loop: a train.py process per timed chunk (CUDA's start-up each time), so a step of its own, two chunks each
step bench_loop 110 python bench.py --preset=gpt2 "${device[@]}" --sections=loop --repeats=2 \
    --out="$out/bench_loop.json" "${tiny[@]}"
step bench_gpt2_decode_b8 60 python bench.py --preset=gpt2 "${device[@]}" --sections=decode --decode_batch_size=8 \
    --gen_repeats=1 --out="$out/bench_gpt2_decode_b8.json" "${tiny[@]}"
echo "results in $out"
