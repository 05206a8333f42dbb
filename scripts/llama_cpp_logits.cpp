// llama.cpp's logits for a sequence of token ids, every position, from one GGUF: what
// scripts/compare_llama_cpp.py compares with ours. Built by scripts/build_llama_cpp.sh against the
// libllama of the llama-cpp-python source package that scripts/fetch_llama_converter.sh names.
//
//     llama-cpp-logits model.gguf ids.txt logits.f32     # ids.txt: token ids, whitespace-separated
//
// Writes len(ids) rows of n_vocab float32 logits (row i: the logits after ids[0..i]), one batch, CPU only.
#include "llama.h"

#include <cstdio>
#include <fstream>
#include <vector>

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s model.gguf ids.txt logits.f32\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> ids;
    std::ifstream in(argv[2]);
    for (llama_token id; in >> id;) {
        ids.push_back(id);
    }
    if (ids.empty()) {
        fprintf(stderr, "error: no token ids in %s\n", argv[2]);
        return 2;
    }
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (model == nullptr) {
        fprintf(stderr, "error: cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = ids.size();  // one batch: every position at once
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        fprintf(stderr, "error: cannot make a context of %zu tokens\n", ids.size());
        return 1;
    }
    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    for (size_t i = 0; i < ids.size(); ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, ids[i]);
        const llama_pos pos = i;
        if (idx < 0 || !llama_batch_ext_set_pos(batch, idx, &pos) || !llama_batch_ext_set_output_logits(batch, idx, true)) {
            fprintf(stderr, "error: cannot add token %zu (id %d) to the batch\n", i, ids[i]);
            return 1;
        }
    }
    if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch) != 0) {
        fprintf(stderr, "error: decode failed\n");
        return 1;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * out = fopen(argv[3], "wb");
    for (size_t i = 0; i < ids.size(); ++i) {
        fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, out);
    }
    fclose(out);
    fprintf(stderr, "%zu positions x %d logits to %s\n", ids.size(), n_vocab, argv[3]);
    llama_batch_ext_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
