// Part of every kernel library: the table of its kernels that the executor reads
// (tsim_kernels), filled by the registrars build.rs appends to each .cu file's unit.
// Never instrumented.
#include <vector>

#include "tsim_abi.h"

namespace {
std::vector<tsim_kernel>& table() {
    static std::vector<tsim_kernel> t;
    return t;
}
// The library's thread-local block holds only its __shared__ variables and this byte;
// touching it makes the loader allocate the block for the calling thread.
thread_local char tls_anchor;
}  // namespace

extern "C" void tsim_register(const tsim_kernel* k, size_t n) { table().insert(table().end(), k, k + n); }

extern "C" __attribute__((visibility("default"))) const tsim_kernel* tsim_kernels(size_t* count, unsigned* abi,
                                                                                 int* checked) {
    *count = table().size();
    *abi = TSIM_ABI_VERSION;
#ifdef TSIM_CHECKED
    *checked = 1;
#else
    *checked = 0;
#endif
    return table().data();
}

extern "C" __attribute__((visibility("default"))) void* tsim_tls_touch() { return &tls_anchor; }
