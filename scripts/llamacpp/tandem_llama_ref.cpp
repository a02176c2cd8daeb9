// tandem-llama-ref: llama.cpp's own answers for Tandem's reference fixtures.
//
// Built against libllama by scripts/build-llama-tools.sh; driven by
// scripts/llamacpp_reference.py, which writes the committed fixtures. It reads commands
// on stdin, one per line, and answers each with one JSON line on stdout:
//
//   T <add_special 0|1> <parse_special 0|1> <text as hex UTF-8 bytes, or "-" if empty>
//       -> {"ids":[...]}            llama_tokenize exactly as llama-server calls it
//   G <n_gen> <top_k> <id,id,...>
//       -> {"steps":[{"token":t,"top":[[id,logit],...]},...]}
//          the prompt is evaluated from an empty cache, then n_gen greedy tokens; step 0
//          is the distribution after the prompt, step i the one after i generated tokens;
//          "top" holds the top_k logits of that distribution, highest first (ties: lower id)
//   I   -> {"n_vocab":N,"add_bos":b,"eos":id}
//
// Threads, context size and KV type are fixed (2 threads, 4096 tokens, F16 KV) so that
// a rerun on the same machine gives the same numbers.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static std::string unhex(const std::string & h) {
    std::string out;
    if (h == "-") {
        return out;
    }
    for (size_t i = 0; i + 1 < h.size(); i += 2) {
        out.push_back((char) std::strtol(h.substr(i, 2).c_str(), nullptr, 16));
    }
    return out;
}

static std::vector<llama_token> parse_ids(const std::string & s) {
    std::vector<llama_token> ids;
    size_t at = 0;
    while (at < s.size()) {
        size_t end = s.find(',', at);
        if (end == std::string::npos) {
            end = s.size();
        }
        ids.push_back((llama_token) std::atoi(s.substr(at, end - at).c_str()));
        at = end + 1;
    }
    return ids;
}

static void print_ids(const std::vector<llama_token> & ids) {
    printf("[");
    for (size_t i = 0; i < ids.size(); i++) {
        printf(i ? ",%d" : "%d", ids[i]);
    }
    printf("]");
}

// The top_k (id, logit) pairs of one distribution: highest logit first, lower id on ties.
static std::vector<std::pair<int, float>> top(const float * logits, int n_vocab, int k) {
    std::vector<int> idx(n_vocab);
    for (int i = 0; i < n_vocab; i++) {
        idx[i] = i;
    }
    k = std::min(k, n_vocab);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    std::vector<std::pair<int, float>> out;
    for (int i = 0; i < k; i++) {
        out.emplace_back(idx[i], logits[idx[i]]);
    }
    return out;
}

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf < commands\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.progress_callback = [](float, void *) { return true; };  // no progress dots
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 4096;
    cp.n_batch = 4096;
    cp.n_ubatch = 512;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot create a context\n");
        return 1;
    }

    std::string line;
    while (std::getline(std::cin, line)) {
        if (line.empty()) {
            continue;
        }
        std::vector<std::string> f;
        size_t at = 0;
        while (at <= line.size()) {
            size_t end = line.find(' ', at);
            if (end == std::string::npos) {
                end = line.size();
            }
            f.push_back(line.substr(at, end - at));
            at = end + 1;
        }
        if (f[0] == "I") {
            printf("{\"n_vocab\":%d,\"add_bos\":%s,\"eos\":%d}\n", n_vocab,
                   llama_vocab_get_add_bos(vocab) ? "true" : "false", llama_vocab_eos(vocab));
        } else if (f[0] == "T" && f.size() == 4) {
            const std::string text = unhex(f[3]);
            std::vector<llama_token> ids(text.size() + 8);
            int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(),
                                   f[1] == "1", f[2] == "1");
            if (n < 0) {
                ids.resize(-n);
                n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(),
                                   f[1] == "1", f[2] == "1");
            }
            ids.resize(std::max(n, 0));
            printf("{\"ids\":");
            print_ids(ids);
            printf("}\n");
        } else if (f[0] == "G" && f.size() == 4) {
            const int n_gen = std::atoi(f[1].c_str());
            const int k = std::atoi(f[2].c_str());
            std::vector<llama_token> prompt = parse_ids(f[3]);
            llama_memory_clear(llama_get_memory(ctx), true);
            printf("{\"steps\":[");
            std::vector<llama_token> next = prompt;
            for (int s = 0; s < n_gen; s++) {
                llama_batch b = llama_batch_get_one(next.data(), (int) next.size());
                if (llama_decode(ctx, b) != 0) {
                    fprintf(stderr, "llama_decode failed at step %d\n", s);
                    return 1;
                }
                const float * logits = llama_get_logits_ith(ctx, -1);
                auto t = top(logits, n_vocab, k);
                printf("%s{\"token\":%d,\"top\":[", s ? "," : "", t[0].first);
                for (size_t i = 0; i < t.size(); i++) {
                    printf("%s[%d,%.7g]", i ? "," : "", t[i].first, t[i].second);
                }
                printf("]}");
                next = { t[0].first };
            }
            printf("]}\n");
        } else {
            fprintf(stderr, "bad command: %s\n", line.substr(0, 80).c_str());
            return 2;
        }
        fflush(stdout);
    }
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
