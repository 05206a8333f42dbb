#!/usr/bin/env bash
# The whole GPU check, one command, each step capped (timeout), under 9 minutes in all on one H100 or H200:
#
#     bash scripts/gpu_check.sh OUT_DIR                 # on a CUDA machine
#     bash scripts/gpu_check.sh OUT_DIR --cpu-dry-run   # the same steps at tiny sizes on the CPU (tests/test_gpu.py)
#
# The data travels with the command: GPT-2's BPE of tiny Shakespeare (302k train tokens, 0.6 MB) in gpu_data/
# (git-ignored; GPU_DATA=DIR names another), made on any machine with the BPE file:
#
#     TIKTOKEN_CACHE_DIR=path/to/tiktoken_cache python data/shakespeare/prepare.py \
#         --input=path/to/tinyshakespeare.txt --out_dir=gpu_data
#
# Steps, caps in seconds (summary.md gives each one's exit status and time; 124 is its cap):
#   train 90      train.py config/gpt2_small.py itself, compiled, bf16, 12 iterations of its 40 x 12 x 1024 tokens
#   resume 50     the same run resumed to iteration 16 (its log.jsonl goes on)
#   torchrun 70   the same under torchrun (python3 -m torch.distributed.run) --standalone --nproc_per_node=1,
#                 8 iterations
#   sweep 80      bench.py's training step at micro-batches 8, 16, 32, 64 x 1024, eager and compiled
#   decode 100    bench.py's decode section: GPT-2 small's step eager, fixed-shape, and captured as a CUDA graph at
#                 batch 1 and the server's 4 and 16, bf16; the step against the bandwidth bound
#   pytest 110    python -m pytest -m gpu, on the test files that mark a test gpu
# summary.md is what docs/performance.md's "On a GPU" takes: train.py's tokens/s, MFU, peak memory and loss, the
# sweep, and decoding's ms a step eager and captured. Offline: no network, no ../shared. OUT_DIR also holds the runs'
# checkpoints (GBs): keep summary.md and the *.txt, *.json and log.jsonl files.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUT_DIR [--cpu-dry-run]}
dry=${2:-}
cd "$(dirname "$0")/.."
data=${GPU_DATA:-gpu_data}
if [ ! -f "$data/train.bin" ]; then
    echo "error: no $data/train.bin: make it (see the top of scripts/gpu_check.sh), or set GPU_DATA=DIR" >&2
    exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
data=$(cd "$data" && pwd)
status=$out/status.txt
: > "$status"

step() {  # step NAME CAP_S COMMAND...: run it, keep its output, record its status; go on either way
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >> "$status"
    echo "   exit $rc after $((SECONDS - t0)) s (cap $limit)"
    tail -n 3 "$out/$name.txt"
}

if [ "$dry" = "--cpu-dry-run" ]; then
    run=(--device=cpu --dtype=float32 --compile=False --threads=1)
    model=(--n_layer=1 --n_head=2 --n_embd=64 --block_size=64 --batch_size=2 --gradient_accumulation_steps=2)
    bench=(--device=cpu --dtype=float32 --compile=False --threads=1 --warmup=1 --repeats=1 --n_layer=1 --n_head=2
           --n_embd=64 --block_size=64 --vocab_size=512 --train_batch_sizes=1,2 --decode_n_layer=1 --decode_n_head=2
           --decode_n_embd=64 --decode_block_size=64 --decode_vocab_size=512 --decode_contexts=32
           --gen_new_tokens=8 --bound_models=quickstart --bound_steps=2 --fixed_precisions=float32
           --fixed_batches=1,4 --fixed_rounds=1 --fixed_steps=2)
else
    run=(--device=cuda --dtype=bfloat16 --compile=True)
    model=()
    bench=(--device=cuda --dtype=bfloat16 --warmup=3 --repeats=5 --decode_contexts=512 --gen_new_tokens=100
           --gen_repeats=1 --bound_models=gpt2 --fixed_precisions=bfloat16 --fixed_batches=1,4,16 --fixed_rounds=3)
fi
common=(config/gpt2_small.py --data_dir="$data" --warmup_iters=2 --eval_interval=1000 --eval_iters=2 --log_interval=1
        --overwrite=True "${run[@]}" "${model[@]}")

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available',
        torch.cuda.is_available()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
} > "$out/environment.txt" 2>&1
tail -n 2 "$out/environment.txt"

step train 90 python3 train.py "${common[@]}" --out_dir="$out/run" --max_iters=12 --lr_decay_iters=16
step resume 50 python3 train.py --init_from=resume --out_dir="$out/run" --max_iters=16 "${run[@]}"
step torchrun 70 python3 -m torch.distributed.run --standalone --nproc_per_node=1 train.py "${common[@]}" \
    --out_dir="$out/run_torchrun" --max_iters=8 --lr_decay_iters=8
step sweep 80 python3 bench.py --preset=gpt2 --sections=train --out="$out/sweep.json" "${bench[@]}"
step decode 100 python3 bench.py --preset=gpt2 --sections=decode --out="$out/decode.json" "${bench[@]}"
# Only the files that mark a test gpu are collected (collecting the whole suite imports every test module), in one
# process: the tests share one GPU.
step pytest 110 python3 -m pytest -m gpu -v -rA -p no:cacheprovider -p no:xdist --continue-on-collection-errors \
    $(grep -l "mark\.gpu" tests/test_*.py)

python3 - "$out" > "$out/summary.md" <<'EOF'
"""What docs/performance.md's "On a GPU" takes from OUT_DIR: each step's status, train.py's own log, the sweep,
decoding eager against captured."""
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
lines = [f"GPU check: {(out / 'environment.txt').read_text().strip().splitlines()[-1]}", "",
         "| step | exit | s |", "|---|---:|---:|"]
lines += [f"| {name} | {rc}{' (cap)' if rc == '124' else ''} | {s} |"
          for name, rc, s in (line.split() for line in (out / "status.txt").read_text().splitlines())]


def log_rows(run: str, first: int, last: int) -> list[dict]:
    path = out / run / "log.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r for r in records if "loss" in r and first <= r["iter"] <= last]


lines += ["", "| train.py, config/gpt2_small.py | iterations | loss first -> last | tokens/s (median) | MFU (last) "
          "| peak memory |", "|---|---|---|---:|---:|---:|"]
for name, run, first, last in [("train", "run", 0, 11), ("resumed", "run", 12, 15),
                               ("torchrun, 1 process", "run_torchrun", 0, 7)]:
    rows = log_rows(run, first, last)
    if not rows:
        lines.append(f"| {name} | none logged | | | | |")
        continue
    timed = [r["tok_per_s"] for r in rows if r["iter"] >= first + 2] or [r["tok_per_s"] for r in rows]
    mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
    peak = max((r.get("peak_mib", 0) for r in rows), default=0)
    lines.append(f"| {name} | {rows[0]['iter']}-{rows[-1]['iter']} | {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} "
                 f"| {statistics.median(timed):,.0f} | {f'{mfu[-1]:.1%}' if mfu else '-'} | "
                 f"{f'{peak:,.0f} MiB' if peak else '-'} |")


def section(name: str, key: str) -> dict:
    path = out / f"{name}.json"
    return json.loads(path.read_text()).get(key, {}) if path.exists() else {}


lines += ["", "| micro-batch x 1024 | mode | step ms | tokens/s | MFU | peak memory |", "|---:|---|---:|---:|---:|---:|"]
for r in section("sweep", "train").get("rows", []):
    if "error" in r:
        lines.append(f"| {r['batch_size']} | {r['mode']} | {r['error']} | | | |")
        continue
    mfu, peak = r.get("mfu"), r.get("peak_memory_bytes")
    lines.append(f"| {r['batch_size']} | {r['mode']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
                 f"{f'{mfu:.1%}' if mfu else '-'} | {f'{peak / 2**20:,.0f} MiB' if peak else '-'} |")
fixed = section("decode", "decode").get("fixed", {})
lines += ["", f"| decode, context {fixed.get('context', '?')} | batch | eager ms | fixed-shape ms | captured ms "
          "| captured: first 3 calls s |", "|---|---:|---:|---:|---:|---:|"]
for r in fixed.get("rows", []):
    cell = lambda way: r.get(f"{way}_error") or (f"{r[way + '_ms']:.3f}" if way + "_ms" in r else "-")
    lines.append(f"| {r['precision']} | {r['batch']} | {cell('eager')} | {cell('fixed')} | {cell('compiled')} | "
                 f"{r.get('compiled_first3_s', 0):.1f} |")
print("\n".join(lines))
EOF
cat "$out/summary.md"
echo "results in $out"
