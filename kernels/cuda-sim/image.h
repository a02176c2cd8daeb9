// Reading CUDA module images (cubin / PTX) and kernel-library symbols; see image.cpp.
#ifndef TSIM_IMAGE_H
#define TSIM_IMAGE_H

#include <stdint.h>

#include <string>
#include <vector>

namespace tsim {

struct ImageEntry {
    std::string name;
    std::vector<unsigned> param_sizes;  // bytes per parameter, in order
    bool sizes_known = false;
};

// The entry points of a module image (cubin or NUL-terminated PTX); "" or what is wrong.
std::string parse_module_image(const void* image, std::vector<ImageEntry>* out, std::string* kind);

struct TlsSymbol {
    uint64_t offset, size;  // within the library's thread-local block
    std::string name;       // mangled
};

// The thread-local variables of a shared library file (its __shared__ variables).
std::vector<TlsSymbol> tls_symbols(const char* path);

}  // namespace tsim

#endif
