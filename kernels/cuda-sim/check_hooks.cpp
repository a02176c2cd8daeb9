// Part of the checked kernel libraries: GCC's -fsanitize=thread instrumentation calls these
// for every load and store of kernel code (the sanitizer's own runtime is not linked);
// each forwards the access to the executor's detectors (checks.cpp). Not instrumented,
// hidden: they bind inside the library only.
#include <stddef.h>
#include <stdint.h>

#include "tsim_abi.h"

#define HOOK extern "C" __attribute__((visibility("hidden"), noinline))
#define PC __builtin_return_address(0)

// Accesses to the calling CUDA thread's own stack (its locals) are not checked: decided
// here, before the call into the executor (most accesses of unoptimized spills are these).
static inline __attribute__((always_inline)) bool own_stack(const void* p) {
    uintptr_t sp;
    __asm__("movq %%rsp, %0" : "=r"(sp));
    return (((uintptr_t)p ^ sp) & ~(uintptr_t)(TSIM_STACK_BYTES - 1)) == 0;
}
#define CHECK(p, n, w) \
    if (!own_stack(p)) tsim_check_access(p, n, w, PC)

HOOK void __tsan_init() {}
HOOK void __tsan_func_entry(void*) {}
HOOK void __tsan_func_exit() {}

#define ACCESS(n)                                                                                 \
    HOOK void __tsan_read##n(void* p) { CHECK(p, n, 0); }                         \
    HOOK void __tsan_write##n(void* p) { CHECK(p, n, 1); }                        \
    HOOK void __tsan_unaligned_read##n(void* p) { CHECK(p, n, 0); }               \
    HOOK void __tsan_unaligned_write##n(void* p) { CHECK(p, n, 1); }              \
    HOOK void __tsan_volatile_read##n(void* p) { CHECK(p, n, 0); }                \
    HOOK void __tsan_volatile_write##n(void* p) { CHECK(p, n, 1); }               \
    HOOK void __tsan_unaligned_volatile_read##n(void* p) { CHECK(p, n, 0); }      \
    HOOK void __tsan_unaligned_volatile_write##n(void* p) { CHECK(p, n, 1); }

ACCESS(1)
ACCESS(2)
ACCESS(4)
ACCESS(8)
ACCESS(16)

HOOK void __tsan_read_range(void* p, size_t n) { CHECK(p, (unsigned)n, 0); }
HOOK void __tsan_write_range(void* p, size_t n) { CHECK(p, (unsigned)n, 1); }
