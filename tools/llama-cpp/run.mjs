// One GGUF in llama.cpp's runtime (node-llama-cpp's prebuilt CPU build): greedy decoding from prompt ids,
// one JSON line on stdout. tests/test_llama_cpp.py compares its ids and log-probabilities with ours;
// benchmarks/peers.py reads its tokens/s.
//
//     node tools/llama-cpp/run.mjs --model=m.gguf --prompt=464,2068,7586 --tokens=32 [--threads=1]
//         [--parallel=16] [--logprobs] [--kv_cache=F32]
//     node tools/llama-cpp/run.mjs --model=m.gguf --text="ROMEO:" --tokens=32    # read by llama.cpp's tokenizer
//
// Prints {"prompt": [the prompt's ids], "ids": [[...] per sequence], "decode_s", "tokens_per_s", and with --logprobs "logprobs": [[...]
// per generated token, log-probability of every vocabulary id]}. The ids come from llama.cpp's greedy
// sampler (temperature 0). tokens_per_s counts every sequence's tokens after its first (the prefill's)
// over the time from the first token to the last. --parallel=K decodes K copies of the prompt at once in
// one context, and llama.cpp batches their steps. --threads=0 leaves llama.cpp its own choice.
// --kv_cache: the cache's ggml type, llama.cpp's default F16 (F32 for a comparison in float32). Flash
// attention stays off: on the CPU it sums in float16, 3e-3 off in log-probability where float32 is 7e-6.
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

function options(argv) {
    const opts = {model: "", prompt: "", text: "", tokens: 32, threads: 0, parallel: 1, logprobs: false, kv_cache: "F16"};
    for (const arg of argv) {
        const [key, value] = arg.replace(/^--/, "").split("=", 2);
        if (!(key in opts)) throw new Error(`unknown option --${key}; known: ${Object.keys(opts).join(", ")}`);
        opts[key] = typeof opts[key] === "number" ? Number(value) : typeof opts[key] === "boolean" ? true : value;
    }
    if (!opts.model || !(opts.prompt || opts.text)) throw new Error("pass --model=FILE.gguf and --prompt=ID,ID,... or --text=TEXT");
    return opts;
}

// One sequence's greedy continuation; stamps[i] is when its token i arrived.
async function greedy(sequence, prompt, n) {
    const ids = [], stamps = [];
    for await (const token of sequence.evaluate(prompt, {temperature: 0, yieldEogToken: true})) {
        ids.push(token);
        stamps.push(performance.now());
        if (ids.length === n) break;
    }
    return {ids, stamps};
}

// The log-probability of every id after each of prompt + ids[:-1]'s last len(ids) positions: llama.cpp's
// probabilities at temperature 1 with nothing cut (top-k the whole vocabulary, top-p 1, min-p 0), one
// batch. Ids llama.cpp leaves out of its list (probability 0) are -Infinity, written as null.
async function logprobs(sequence, prompt, ids, vocab) {
    const tokens = [...prompt, ...ids.slice(0, -1)];
    const sampling = {temperature: 1, topK: vocab, topP: 1, minP: 0};
    const input = tokens.map((t, i) => i < prompt.length - 1 ? t : [t, {generateNext: {probabilities: true, options: sampling}}]);
    const out = await sequence.controlledEvaluate(input);
    return out.filter(item => item?.next?.probabilities).map(item => {
        const row = new Array(vocab).fill(null);
        for (const [id, p] of item.next.probabilities) row[id] = p > 0 ? Math.log(p) : null;
        return row;
    });
}

const opts = options(process.argv.slice(2));
const threads = opts.threads > 0 ? {maxThreads: opts.threads} : {};
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error, ...threads});
const model = await llama.loadModel({modelPath: opts.model});
const vocab = model.fileInfo.metadata.tokenizer.ggml.tokens.length;
const prompt = opts.text ? model.tokenize(opts.text) : opts.prompt.split(",").map(Number);
const context = await model.createContext({
    sequences: opts.parallel, contextSize: opts.parallel * (prompt.length + opts.tokens + 8),
    batchSize: Math.max(512, opts.parallel * prompt.length), ...(opts.threads > 0 ? {threads: opts.threads} : {}),
    experimentalKvCacheKeyType: opts.kv_cache, experimentalKvCacheValueType: opts.kv_cache, flashAttention: false});
const sequences = Array.from({length: opts.parallel}, () => context.getSequence());
const runs = await Promise.all(sequences.map(s => greedy(s, prompt, opts.tokens)));
const first = Math.min(...runs.map(r => r.stamps[0])), last = Math.max(...runs.map(r => r.stamps.at(-1)));
const decoded = runs.reduce((n, r) => n + r.ids.length - 1, 0);
const result = {prompt, ids: runs.map(r => r.ids), decode_s: (last - first) / 1000,
                tokens_per_s: decoded / ((last - first) / 1000)};
if (opts.logprobs) {
    await sequences[0].clearHistory();
    result.logprobs = await logprobs(sequences[0], prompt, runs[0].ids, vocab);
}
console.log(JSON.stringify(result));
await context.dispose();
await model.dispose();
await llama.dispose();
