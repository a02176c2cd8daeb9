// The stand-in libcuda.so.1: the CUDA driver functions cudarc calls for Tandem, on the
// CPU. See README.md for what it guarantees and what it does not.
//
// - One device ("Tandem CUDA executor (CPU)", compute capability 9.0), one primary
//   context, which must be current on the calling thread as with the real driver.
// - Device memory is host memory (256-byte aligned); device pointers are host pointers.
//   Copies and memsets are checked against the live allocations (CUDA_ERROR_INVALID_VALUE
//   outside them).
// - Streams have no asynchrony: work runs when it is enqueued, in order, on the calling
//   thread, so synchronization has nothing to wait for.
// - Modules: cuModuleLoadData takes NVRTC's cubin or PTX, reads its entry points and
//   their parameter sizes; cuModuleGetFunction finds the entry in the image and the kernel
//   of that name in the CPU-compiled kernel libraries (tsim_load_library), and refuses one
//   whose CPU signature's parameter sizes differ from the image's.
// - cuLaunchKernel validates the launch like the driver, then runs it (executor.h).
// - Stream capture records launches with a copy of their parameters; instantiate, upload
//   and launch replay them. A copy, memset, allocation, free or synchronization during a
//   capture is refused with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the
//   capture (the real driver would capture some of these as graph nodes; Tandem's
//   captures must not contain any, so the stand-in is stricter).
// - It refuses to start (cuInit fails) on a machine with an NVIDIA kernel driver.
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <time.h>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda_types.h"
#include "executor.h"
#include "image.h"

using namespace tsim;

#define API extern "C" __attribute__((visibility("default")))

namespace {

struct Lib {
    void* handle = nullptr;
    std::string path;
    bool checked = false;
    void* (*tls_touch)() = nullptr;
    std::vector<Range> image;  // its mapped segments (constant tables kernels may read)
    std::vector<TlsSymbol> tls;
    size_t tls_bytes = 0;
};

struct KernelPair {
    const tsim_kernel* fast = nullptr;
    const tsim_kernel* checked = nullptr;
    Lib* checked_lib = nullptr;
};

struct Node {
    const KernelPair* k;
    tsim_dim3 grid, block;
    unsigned smem;
    std::vector<uint8_t> bytes;  // the parameters' values, back to back
    std::vector<size_t> offsets;
};

struct Module {
    std::vector<ImageEntry> entries;
    std::string kind;
};
struct Function {
    Module* module;
    const KernelPair* k;
};
struct Stream {
    bool capturing = false, invalidated = false;
    int mode = 0;
    std::thread::id capturer;
    std::vector<Node> nodes;
};
struct Graph {
    std::vector<Node> nodes;
};
struct Event {};
struct Ctx {
    int refs = 0;
};

std::mutex g_mu;
bool g_initialized = false;
Ctx g_primary;
std::vector<Lib*> g_libs;
std::map<std::string, KernelPair> g_kernels;
std::map<uintptr_t, size_t> g_allocs;
size_t g_used = 0;
std::set<void*> g_modules, g_functions, g_streams, g_graphs, g_execs, g_events;
thread_local std::string t_last_error;  // of launches made by this thread
Options g_default_options;
thread_local Ctx* t_ctx = nullptr;
thread_local bool t_options_set = false;
int g_capturing = 0;  // active captures (any stream)

const size_t kTotalMem = 16ull << 30;

// TANDEM_CUDA_SIM_PROFILE=1: per kernel, launches (checked ones too), blocks, fiber
// switches and CPU seconds, printed to stderr when the process exits (where a suite's
// executor time goes). TANDEM_CUDA_SIM_PROFILE=<file>: the same rows appended to the file
// ("name launches checked blocks switches cpu_seconds"), for `make cuda-sim` to check that
// every kernel ran under the detectors.
struct Profile {
    uint64_t launches = 0, checked = 0, blocks = 0, switches = 0;
    double seconds = 0;
};
std::map<std::string, Profile> g_profiles;
const char* const g_profile_to = getenv("TANDEM_CUDA_SIM_PROFILE");
const bool g_profile = g_profile_to && *g_profile_to && strcmp(g_profile_to, "0") != 0;

// CPU time of the calling thread: what a launch costs, whatever else the machine runs.
double thread_cpu_seconds() {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void print_profile() {
    std::lock_guard<std::mutex> g(g_mu);
    if (g_profiles.empty()) return;
    std::vector<std::pair<std::string, Profile>> rows(g_profiles.begin(), g_profiles.end());
    std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.second.seconds > b.second.seconds; });
    if (strcmp(g_profile_to, "1") != 0) {
        FILE* f = fopen(g_profile_to, "a");
        if (!f) return;
        for (auto& r : rows)
            fprintf(f, "%s %llu %llu %llu %llu %.3f\n", r.first.c_str(), (unsigned long long)r.second.launches,
                    (unsigned long long)r.second.checked, (unsigned long long)r.second.blocks,
                    (unsigned long long)r.second.switches, r.second.seconds);
        fclose(f);
        return;
    }
    double total = 0;
    for (auto& r : rows) total += r.second.seconds;
    fprintf(stderr, "tandem CUDA executor profile (pid %d): %.1f CPU seconds in kernels\n", (int)getpid(), total);
    fprintf(stderr, "  %-22s %9s %9s %11s %14s %9s\n", "kernel", "launches", "checked", "blocks", "switches", "CPU s");
    for (auto& r : rows)
        fprintf(stderr, "  %-22s %9llu %9llu %11llu %14llu %9.2f\n", r.first.c_str(),
                (unsigned long long)r.second.launches, (unsigned long long)r.second.checked,
                (unsigned long long)r.second.blocks, (unsigned long long)r.second.switches, r.second.seconds);
}
const int g_profile_at_exit = g_profile ? atexit(print_profile) : 0;


Options& options() {
    if (!t_options_set) {
        std::lock_guard<std::mutex> g(g_mu);
        thread_options() = g_default_options;
        t_options_set = true;
    }
    return thread_options();
}

bool real_driver_present(std::string* why) {
    struct stat st;
    for (const char* p : {"/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0"})
        if (stat(p, &st) == 0) {
            *why = p;
            return true;
        }
    return false;
}

void note_error(const std::string& e) {
    fprintf(stderr, "tandem CUDA executor: %s\n", e.c_str());
    t_last_error = e;
}

// Whether [p, p + n) lies in one live allocation (caller holds g_mu).
bool in_alloc(uintptr_t p, size_t n) {
    auto it = g_allocs.upper_bound(p);
    if (it == g_allocs.begin()) return false;
    --it;
    return p >= it->first && p + n <= it->first + it->second && n <= it->second;
}

bool is_default_stream(CUstream s) { return s == nullptr || s == (CUstream)1 || s == (CUstream)2; }

// A stream argument: valid handle, and (capture_rule) the capture rules for operations
// that may not be captured. Returns CUDA_SUCCESS or the error (caller holds g_mu).
CUresult check_stream(CUstream s, bool capture_unsafe) {
    if (!t_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (is_default_stream(s)) {
        if (capture_unsafe && g_capturing) {
            // The legacy stream synchronizes with every stream: refused during captures.
            for (void* p : g_streams) ((Stream*)p)->invalidated |= ((Stream*)p)->capturing;
            return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
        }
        return CUDA_SUCCESS;
    }
    if (!g_streams.count(s)) return CUDA_ERROR_INVALID_HANDLE;
    Stream* st = (Stream*)s;
    if (capture_unsafe && st->capturing) {
        st->invalidated = true;
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    return CUDA_SUCCESS;
}

// Capture-unsafe calls not tied to a stream (synchronous allocation, copies, context
// synchronization) from a thread that a capture covers (caller holds g_mu).
CUresult check_unsafe_call() {
    if (!t_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    CUresult r = CUDA_SUCCESS;
    for (void* p : g_streams) {
        Stream* st = (Stream*)p;
        if (!st->capturing || st->mode == CU_STREAM_CAPTURE_MODE_RELAXED) continue;
        if (st->mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL && st->capturer != std::this_thread::get_id()) continue;
        st->invalidated = true;
        r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    return r;
}

CUresult run_node(const Node& n) {
    Options opt = options();
    LaunchEnv env;
    const KernelPair& k = *n.k;
    // The checked library when checks are asked for (or it is the only one, as for the
    // self-test kernels); the detectors only when asked for.
    bool use_checked_lib = (opt.checks && k.checked) || !k.fast;
    bool checked = use_checked_lib && opt.checks;
    env.kernel = use_checked_lib ? k.checked : k.fast;
    env.checked = checked;
    env.grid = n.grid;
    env.block = n.block;
    env.smem = n.smem;
    std::vector<void*> params(n.offsets.size());
    for (size_t i = 0; i < n.offsets.size(); i++) params[i] = (void*)(n.bytes.data() + n.offsets[i]);
    env.params = params.data();
    if (checked) {
        Lib* lib = k.checked_lib;
        void* any = lib->tls_touch();  // allocates this thread's block of the library
        void* tls = nullptr;
        if (dlinfo(lib->handle, RTLD_DI_TLS_DATA, &tls) != 0 || !tls || !any) {
            note_error("cannot find the static shared memory of " + lib->path);
            return CUDA_ERROR_LAUNCH_FAILED;
        }
        env.static_smem = {(uintptr_t)tls, (uintptr_t)tls + lib->tls_bytes};
        env.tls_symbols = &lib->tls;
        std::lock_guard<std::mutex> g(g_mu);
        for (auto& a : g_allocs) env.memory.push_back({a.first, a.first + a.second});
        for (const Range& r : lib->image) env.memory.push_back(r);
        std::sort(env.memory.begin(), env.memory.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
    }
    double t0 = thread_cpu_seconds();
    std::string err = run_launch(env, opt);
    if (g_profile) {
        double ns = (thread_cpu_seconds() - t0) * 1e9;
        std::lock_guard<std::mutex> g(g_mu);
        Profile& p = g_profiles[env.kernel->name];
        p.launches++;
        p.checked += env.checked ? 1 : 0;
        p.blocks += (uint64_t)n.grid.x * n.grid.y * n.grid.z;
        p.switches += env.switches;
        p.seconds += ns * 1e-9;
    }
    if (err.empty()) return CUDA_SUCCESS;
    note_error(err);
    return CUDA_ERROR_LAUNCH_FAILED;
}

int image_segments(struct dl_phdr_info* info, size_t, void* data) {
    Lib* lib = (Lib*)data;
    if (!info->dlpi_name || lib->path != info->dlpi_name) return 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type == PT_LOAD)
            lib->image.push_back({info->dlpi_addr + ph.p_vaddr, info->dlpi_addr + ph.p_vaddr + ph.p_memsz});
        if (ph.p_type == PT_TLS) lib->tls_bytes = ph.p_memsz;
    }
    return 1;
}

}  // namespace

// ---- Executor control (not part of the CUDA driver API) ----

API unsigned tsim_abi_version() { return TSIM_ABI_VERSION; }

// Loads a kernel library (its kernels become launchable by name); "" or the error.
API int tsim_load_library(const char* path, char* err, size_t err_len) {
    auto fail = [&](const std::string& e) {
        snprintf(err, err_len, "%s", e.c_str());
        return 1;
    };
    void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) return fail(std::string("cannot load kernel library: ") + dlerror());
    auto list = (tsim_kernels_fn)dlsym(h, "tsim_kernels");
    auto touch = (void* (*)())dlsym(h, "tsim_tls_touch");
    if (!list || !touch) return fail(std::string(path) + " is not a kernel library (no tsim_kernels)");
    size_t n = 0;
    unsigned abi = 0;
    int checked = 0;
    const tsim_kernel* ks = list(&n, &abi, &checked);
    if (abi != TSIM_ABI_VERSION)
        return fail(std::string(path) + ": built for executor ABI " + std::to_string(abi) + ", this is " +
                    std::to_string(TSIM_ABI_VERSION));
    Lib* lib = new Lib();
    lib->handle = h;
    lib->path = path;
    lib->checked = checked != 0;
    lib->tls_touch = touch;
    dl_iterate_phdr(image_segments, lib);
    lib->tls = tls_symbols(path);
    std::lock_guard<std::mutex> g(g_mu);
    for (size_t i = 0; i < n; i++) {
        KernelPair& p = g_kernels[ks[i].name];
        if (lib->checked) {
            p.checked = &ks[i];
            p.checked_lib = lib;
        } else {
            p.fast = &ks[i];
        }
    }
    g_libs.push_back(lib);
    return 0;
}

// Options of launches made by the calling thread (order: 0 forward, 1 reverse, 2 random).
API void tsim_set_thread_options(int order, uint64_t seed, int checks) {
    options() = Options{(Order)order, seed, checks != 0};
}
API void tsim_get_thread_options(int* order, uint64_t* seed, int* checks) {
    Options& o = options();
    *order = (int)o.order;
    *seed = o.seed;
    *checks = o.checks;
}
// Defaults of threads that set none.
API void tsim_set_default_options(int order, uint64_t seed, int checks) {
    std::lock_guard<std::mutex> g(g_mu);
    g_default_options = Options{(Order)order, seed, checks != 0};
}
// launches, blocks, threads, fiber switches, checked launches, CPU nanoseconds in
// launches (process totals).
API void tsim_stats(uint64_t out[6]) {
    Stats s = stats();
    out[0] = s.launches;
    out[1] = s.blocks;
    out[2] = s.threads;
    out[3] = s.switches;
    out[4] = s.checked_launches;
    out[5] = s.cpu_ns;
}
// The report of the calling thread's last failed launch ("" if none); its length.
API size_t tsim_last_error(char* buf, size_t len) {
    if (len) snprintf(buf, len, "%s", t_last_error.c_str());
    return t_last_error.size();
}
// Live device allocations: count and bytes.
API void tsim_memory(uint64_t* allocations, uint64_t* bytes) {
    std::lock_guard<std::mutex> g(g_mu);
    *allocations = g_allocs.size();
    *bytes = g_used;
}

// ---- Initialization, device, context ----

API CUresult cuInit(unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    std::string why;
    if (real_driver_present(&why)) {
        fprintf(stderr,
                "tandem CUDA executor: this machine has an NVIDIA driver (%s); the CPU executor does not stand "
                "in for it (run tests/gpu/run.sh instead)\n",
                why.c_str());
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    std::lock_guard<std::mutex> g(g_mu);
    g_initialized = true;
    return CUDA_SUCCESS;
}

#define NEED_INIT()                                     \
    do {                                                \
        if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)

// The driver's private interfaces (NVRTC asks for them when it finds a libcuda in the
// process): none here, which NVRTC handles.
API CUresult cuGetExportTable(const void** table, const void* id) {
    (void)id;
    if (table) *table = nullptr;
    return CUDA_ERROR_NOT_SUPPORTED;
}

API CUresult cuDriverGetVersion(int* v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 12090;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetCount(int* n) {
    NEED_INIT();
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = 1;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    NEED_INIT();
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    NEED_INIT();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "Tandem CUDA executor (CPU)");
    return CUDA_SUCCESS;
}
API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    NEED_INIT();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = kTotalMem;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetUuid(CUuuid* u, CUdevice d) {
    NEED_INIT();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!u) return CUDA_ERROR_INVALID_VALUE;
    memcpy(u->bytes, "tandem-cuda-sim", 16);
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetUuid_v2(CUuuid* u, CUdevice d) { return cuDeviceGetUuid(u, d); }
API CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
    NEED_INIT();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: *v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *v = 48 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = 48 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *v = 1; break;
    default: return CUDA_ERROR_INVALID_VALUE;  // not modelled: fail loudly
    }
    return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
    NEED_INIT();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_mu);
    g_primary.refs++;
    *c = (CUcontext)&g_primary;
    return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    NEED_INIT();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> g(g_mu);
    if (g_primary.refs <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    g_primary.refs--;
    return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRelease(CUdevice d) { return cuDevicePrimaryCtxRelease_v2(d); }
API CUresult cuCtxGetCurrent(CUcontext* c) {
    NEED_INIT();
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    *c = (CUcontext)t_ctx;
    return CUDA_SUCCESS;
}
API CUresult cuCtxSetCurrent(CUcontext c) {
    NEED_INIT();
    if (c && c != (CUcontext)&g_primary) return CUDA_ERROR_INVALID_CONTEXT;
    if (c && g_primary.refs <= 0) return CUDA_ERROR_INVALID_CONTEXT;  // released
    t_ctx = (Ctx*)c;
    return CUDA_SUCCESS;
}
API CUresult cuCtxSynchronize() {
    std::lock_guard<std::mutex> g(g_mu);
    return check_unsafe_call();
}
API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!t_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (free_bytes) *free_bytes = kTotalMem - g_used;
    if (total) *total = kTotalMem;
    return CUDA_SUCCESS;
}

// ---- Errors ----

API CUresult cuGetErrorName(CUresult e, const char** s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    *s = cu_error_name(e);
    return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
API CUresult cuGetErrorString(CUresult e, const char** s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    *s = cu_error_string(e);
    return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// ---- Streams and events ----

API CUresult cuStreamCreate(CUstream* s, unsigned flags) {
    (void)flags;
    std::lock_guard<std::mutex> g(g_mu);
    if (!t_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    Stream* st = new Stream();
    g_streams.insert(st);
    *s = (CUstream)st;
    return CUDA_SUCCESS;
}
API CUresult cuStreamCreateWithPriority(CUstream* s, unsigned flags, int) { return cuStreamCreate(s, flags); }
API CUresult cuStreamDestroy_v2(CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_streams.count(s)) return CUDA_ERROR_INVALID_HANDLE;
    Stream* st = (Stream*)s;
    if (st->capturing) g_capturing--;
    g_streams.erase(s);
    delete st;
    return CUDA_SUCCESS;
}
API CUresult cuStreamSynchronize(CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    return check_stream(s, true);
}
API CUresult cuStreamQuery(CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    return check_stream(s, true);
}
API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
    return check_stream(s, false);
}
API CUresult cuEventCreate(CUevent* e, unsigned) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!t_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    Event* ev = new Event();
    g_events.insert(ev);
    *e = (CUevent)ev;
    return CUDA_SUCCESS;
}
API CUresult cuEventDestroy_v2(CUevent e) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_events.erase(e)) return CUDA_ERROR_INVALID_HANDLE;
    delete (Event*)e;
    return CUDA_SUCCESS;
}
API CUresult cuEventRecord(CUevent e, CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
    return check_stream(s, true);
}
API CUresult cuEventSynchronize(CUevent e) {
    std::lock_guard<std::mutex> g(g_mu);
    return g_events.count(e) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
API CUresult cuEventQuery(CUevent e) { return cuEventSynchronize(e); }
API CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!ms || !g_events.count(a) || !g_events.count(b)) return CUDA_ERROR_INVALID_HANDLE;
    *ms = 0.0f;  // no timing model
    return CUDA_SUCCESS;
}

// ---- Memory ----

namespace {
CUresult do_alloc(CUdeviceptr* p, size_t bytes) {
    if (!p || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    if (bytes > kTotalMem - g_used) return CUDA_ERROR_OUT_OF_MEMORY;
    void* m = nullptr;
    if (posix_memalign(&m, 256, bytes) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    g_allocs[(uintptr_t)m] = bytes;
    g_used += bytes;
    *p = (CUdeviceptr)(uintptr_t)m;
    return CUDA_SUCCESS;
}
CUresult do_free(CUdeviceptr p) {
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end()) return CUDA_ERROR_INVALID_VALUE;
    g_used -= it->second;
    g_allocs.erase(it);
    free((void*)(uintptr_t)p);
    return CUDA_SUCCESS;
}
}  // namespace

API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    CUresult r = check_stream(s, true);
    return r ? r : do_alloc(p, bytes);
}
API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    std::lock_guard<std::mutex> g(g_mu);
    CUresult r = check_unsafe_call();
    return r ? r : do_alloc(p, bytes);
}
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    CUresult r = check_stream(s, true);
    return r ? r : do_free(p);
}
API CUresult cuMemFree_v2(CUdeviceptr p) {
    std::lock_guard<std::mutex> g(g_mu);
    CUresult r = check_unsafe_call();
    return r ? r : do_free(p);
}
API CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    CUresult r = check_stream(s, true);
    if (r) return r;
    if (!in_alloc((uintptr_t)p, n)) return CUDA_ERROR_INVALID_VALUE;
    memset((void*)(uintptr_t)p, v, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
    {
        std::lock_guard<std::mutex> g(g_mu);
        CUresult r = check_unsafe_call();
        if (r) return r;
    }
    return cuMemsetD8Async(p, v, n, nullptr);
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    CUresult r = check_stream(s, true);
    if (r) return r;
    if (n && (!src || !in_alloc((uintptr_t)dst, n))) return CUDA_ERROR_INVALID_VALUE;
    memcpy((void*)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    CUresult r = check_stream(s, true);
    if (r) return r;
    if (n && (!dst || !in_alloc((uintptr_t)src, n))) return CUDA_ERROR_INVALID_VALUE;
    memcpy(dst, (const void*)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    CUresult r = check_stream(s, true);
    if (r) return r;
    if (n && (!in_alloc((uintptr_t)src, n) || !in_alloc((uintptr_t)dst, n))) return CUDA_ERROR_INVALID_VALUE;
    memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    {
        std::lock_guard<std::mutex> g(g_mu);
        CUresult r = check_unsafe_call();
        if (r) return r;
    }
    return cuMemcpyHtoDAsync_v2(dst, src, n, nullptr);
}
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    {
        std::lock_guard<std::mutex> g(g_mu);
        CUresult r = check_unsafe_call();
        if (r) return r;
    }
    return cuMemcpyDtoHAsync_v2(dst, src, n, nullptr);
}

// ---- Modules and launches ----

API CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!t_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (!m || !image) return CUDA_ERROR_INVALID_VALUE;
    Module* mod = new Module();
    std::string err = parse_module_image(image, &mod->entries, &mod->kind);
    if (!err.empty() || mod->entries.empty()) {
        delete mod;
        fprintf(stderr, "tandem CUDA executor: cuModuleLoadData: %s\n",
                err.empty() ? "the image has no kernel entry point" : err.c_str());
        return err.empty() || err.find("PTX") == std::string::npos ? CUDA_ERROR_INVALID_IMAGE : CUDA_ERROR_INVALID_PTX;
    }
    g_modules.insert(mod);
    *m = (CUmodule)mod;
    return CUDA_SUCCESS;
}
API CUresult cuModuleUnload(CUmodule m) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_modules.erase(m)) return CUDA_ERROR_INVALID_HANDLE;
    for (auto it = g_functions.begin(); it != g_functions.end();) {
        Function* f = (Function*)*it;
        if (f->module == (Module*)m) {
            delete f;
            it = g_functions.erase(it);
        } else {
            ++it;
        }
    }
    delete (Module*)m;
    return CUDA_SUCCESS;
}
API CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!f || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!g_modules.count(m)) return CUDA_ERROR_INVALID_HANDLE;
    Module* mod = (Module*)m;
    const ImageEntry* entry = nullptr;
    for (const ImageEntry& e : mod->entries)
        if (e.name == name) entry = &e;
    if (!entry) return CUDA_ERROR_NOT_FOUND;  // as the driver: not in this module
    auto k = g_kernels.find(name);
    if (k == g_kernels.end()) {
        fprintf(stderr, "tandem CUDA executor: %s is in the %s module but in no CPU-compiled kernel library\n", name,
                mod->kind.c_str());
        return CUDA_ERROR_NOT_FOUND;
    }
    const tsim_kernel* cpu = k->second.fast ? k->second.fast : k->second.checked;
    if (entry->sizes_known) {
        bool same = entry->param_sizes.size() == cpu->n_params;
        for (unsigned i = 0; same && i < cpu->n_params; i++) same = entry->param_sizes[i] == cpu->param_sizes[i];
        if (!same) {
            std::string a, b;
            for (unsigned s : entry->param_sizes) a += " " + std::to_string(s);
            for (unsigned i = 0; i < cpu->n_params; i++) b += " " + std::to_string(cpu->param_sizes[i]);
            fprintf(stderr,
                    "tandem CUDA executor: %s: parameter sizes differ between the %s module (%s) and the CPU build "
                    "(%s)\n",
                    name, mod->kind.c_str(), a.c_str(), b.c_str());
            return CUDA_ERROR_INVALID_IMAGE;
        }
    }
    Function* fn = new Function{mod, &k->second};
    g_functions.insert(fn);
    *f = (CUfunction)fn;
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned smem, CUstream s, void** params, void** extra) {
    Node n;
    {
        std::lock_guard<std::mutex> g(g_mu);
        CUresult r = check_stream(s, false);
        if (r) return r;
        if (!g_functions.count(f)) return CUDA_ERROR_INVALID_HANDLE;
        if (extra) return CUDA_ERROR_INVALID_VALUE;  // not modelled (cudarc passes none)
        if (!gx || !gy || !gz || !bx || !by || !bz || gy > 65535 || gz > 65535 || gx > 2147483647u || bx > 1024 ||
            by > 1024 || bz > 64 || (uint64_t)bx * by * bz > 1024)
            return CUDA_ERROR_INVALID_VALUE;
        if (smem > 48 * 1024) return CUDA_ERROR_INVALID_VALUE;
        n.k = ((Function*)f)->k;
        const tsim_kernel* cpu = n.k->fast ? n.k->fast : n.k->checked;
        if (cpu->n_params && !params) return CUDA_ERROR_INVALID_VALUE;
        n.grid = {gx, gy, gz};
        n.block = {bx, by, bz};
        n.smem = smem;
        for (unsigned i = 0; i < cpu->n_params; i++) {
            size_t at = (n.bytes.size() + 7) & ~(size_t)7;
            n.bytes.resize(at + cpu->param_sizes[i]);
            memcpy(n.bytes.data() + at, params[i], cpu->param_sizes[i]);
            n.offsets.push_back(at);
        }
        if (!is_default_stream(s) && ((Stream*)s)->capturing) {
            Stream* st = (Stream*)s;
            if (!st->invalidated) st->nodes.push_back(std::move(n));
            return CUDA_SUCCESS;
        }
    }
    return run_node(n);
}

// ---- Stream capture and graphs ----

API CUresult cuStreamBeginCapture_v2(CUstream s, int mode) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!t_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (is_default_stream(s)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (!g_streams.count(s)) return CUDA_ERROR_INVALID_HANDLE;
    if (mode < 0 || mode > 2) return CUDA_ERROR_INVALID_VALUE;
    Stream* st = (Stream*)s;
    if (st->capturing) return CUDA_ERROR_ILLEGAL_STATE;
    st->capturing = true;
    st->invalidated = false;
    st->mode = mode;
    st->capturer = std::this_thread::get_id();
    st->nodes.clear();
    g_capturing++;
    return CUDA_SUCCESS;
}
API CUresult cuStreamBeginCapture(CUstream s, int mode) { return cuStreamBeginCapture_v2(s, mode); }
API CUresult cuStreamIsCapturing(CUstream s, int* status) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    if (is_default_stream(s)) {
        *status = CU_STREAM_CAPTURE_STATUS_NONE;
        return CUDA_SUCCESS;
    }
    if (!g_streams.count(s)) return CUDA_ERROR_INVALID_HANDLE;
    Stream* st = (Stream*)s;
    *status = !st->capturing ? CU_STREAM_CAPTURE_STATUS_NONE
              : st->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    return CUDA_SUCCESS;
}
API CUresult cuStreamEndCapture(CUstream s, CUgraph* out) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    *out = nullptr;
    if (is_default_stream(s) || !g_streams.count(s)) return CUDA_ERROR_INVALID_HANDLE;
    Stream* st = (Stream*)s;
    if (!st->capturing) return CUDA_ERROR_ILLEGAL_STATE;
    if (st->mode != CU_STREAM_CAPTURE_MODE_RELAXED && st->capturer != std::this_thread::get_id())
        return CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    st->capturing = false;
    g_capturing--;
    if (st->invalidated) {
        st->nodes.clear();
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    Graph* gr = new Graph();
    gr->nodes = std::move(st->nodes);
    st->nodes.clear();
    g_graphs.insert(gr);
    *out = (CUgraph)gr;
    return CUDA_SUCCESS;
}
API CUresult cuGraphInstantiateWithFlags(CUgraphExec* e, CUgraph gr, unsigned long long flags) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!e || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (!g_graphs.count(gr)) return CUDA_ERROR_INVALID_HANDLE;
    Graph* ex = new Graph(*(Graph*)gr);
    g_execs.insert(ex);
    *e = (CUgraphExec)ex;
    return CUDA_SUCCESS;
}
API CUresult cuGraphUpload(CUgraphExec e, CUstream s) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_execs.count(e)) return CUDA_ERROR_INVALID_HANDLE;
    return check_stream(s, true);
}
API CUresult cuGraphLaunch(CUgraphExec e, CUstream s) {
    Graph copy;
    {
        std::lock_guard<std::mutex> g(g_mu);
        if (!g_execs.count(e)) return CUDA_ERROR_INVALID_HANDLE;
        CUresult r = check_stream(s, true);  // a graph launched into a capture: not modelled
        if (r) return r;
        copy = *(Graph*)e;
    }
    for (const Node& n : copy.nodes) {
        CUresult r = run_node(n);
        if (r) return r;
    }
    return CUDA_SUCCESS;
}
API CUresult cuGraphExecDestroy(CUgraphExec e) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_execs.erase(e)) return CUDA_ERROR_INVALID_HANDLE;
    delete (Graph*)e;
    return CUDA_SUCCESS;
}
API CUresult cuGraphDestroy(CUgraph gr) {
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_graphs.erase(gr)) return CUDA_ERROR_INVALID_HANDLE;
    delete (Graph*)gr;
    return CUDA_SUCCESS;
}
