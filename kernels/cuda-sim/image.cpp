// What cuModuleLoadData is given (NVRTC's output) and what the executor reads from ELF
// files: the entry points of a CUDA module with their parameter sizes, from a cubin (a
// CUDA ELF: FUNC symbols, EIATTR_KPARAM_INFO records of .nv.info.<kernel>) or from PTX
// text (.entry lines and their .param lists); and the thread-local symbols of a kernel
// library (its __shared__ variables, for naming them in race reports).
#include "image.h"

#include <stdio.h>
#include <string.h>

#include <fstream>
#include <iterator>
#include <map>

namespace tsim {

namespace {

struct Sec {
    uint32_t name, type;
    uint64_t off, size;
    uint32_t link, info;
    uint64_t entsize;
};

template <class T>
bool rd(const uint8_t* d, size_t n, uint64_t off, T* v) {
    if (off > n || n - off < sizeof(T)) return false;
    memcpy(v, d + off, sizeof(T));
    return true;
}

// Section headers of an ELF64 little-endian file of `n` bytes (or "" on success).
std::string sections(const uint8_t* d, size_t n, std::vector<Sec>* out, uint16_t* shstrndx) {
    uint64_t shoff = 0;
    uint16_t shentsize = 0, shnum = 0;
    if (!rd(d, n, 0x28, &shoff) || !rd(d, n, 0x3a, &shentsize) || !rd(d, n, 0x3c, &shnum) ||
        !rd(d, n, 0x3e, shstrndx) || shentsize < 64)
        return "truncated ELF header";
    for (uint16_t i = 0; i < shnum; i++) {
        uint64_t h = shoff + (uint64_t)i * shentsize;
        Sec s{};
        if (!rd(d, n, h, &s.name) || !rd(d, n, h + 4, &s.type) || !rd(d, n, h + 24, &s.off) ||
            !rd(d, n, h + 32, &s.size) || !rd(d, n, h + 40, &s.link) || !rd(d, n, h + 44, &s.info) ||
            !rd(d, n, h + 56, &s.entsize))
            return "truncated section header";
        if (s.type != 8 /* NOBITS */ && (s.off > n || n - s.off < s.size)) return "section outside the image";
        out->push_back(s);
    }
    if (*shstrndx >= out->size()) return "no section name table";
    return "";
}

std::string cstr(const uint8_t* d, size_t n, uint64_t off) {
    std::string s;
    while (off < n && d[off]) s.push_back((char)d[off++]);
    return s;
}

// Bytes an ELF image spans, from its headers (cuModuleLoadData gets no size).
size_t elf_extent(const uint8_t* d) {
    uint64_t shoff, phoff;
    uint16_t shentsize, shnum, phentsize, phnum;
    memcpy(&phoff, d + 0x20, 8);
    memcpy(&shoff, d + 0x28, 8);
    memcpy(&phentsize, d + 0x36, 2);
    memcpy(&phnum, d + 0x38, 2);
    memcpy(&shentsize, d + 0x3a, 2);
    memcpy(&shnum, d + 0x3c, 2);
    uint64_t end = shoff + (uint64_t)shentsize * shnum;
    if (phoff + (uint64_t)phentsize * phnum > end) end = phoff + (uint64_t)phentsize * phnum;
    for (uint16_t i = 0; i < shnum; i++) {
        const uint8_t* h = d + shoff + (uint64_t)i * shentsize;
        uint32_t type;
        uint64_t off, size;
        memcpy(&type, h + 4, 4);
        memcpy(&off, h + 24, 8);
        memcpy(&size, h + 32, 8);
        if (type != 8 && off + size > end) end = off + size;
    }
    return (size_t)end;
}

std::string parse_cubin(const uint8_t* d, size_t n, std::vector<ImageEntry>* out) {
    uint16_t machine;
    memcpy(&machine, d + 0x12, 2);
    if (d[4] != 2 || d[5] != 1) return "not a 64-bit little-endian ELF";
    if (machine != 190) return "an ELF for machine " + std::to_string(machine) + ", not a CUDA cubin (EM_CUDA, 190)";
    std::vector<Sec> secs;
    uint16_t shstr = 0;
    std::string err = sections(d, n, &secs, &shstr);
    if (!err.empty()) return err;
    std::map<std::string, size_t> index;
    for (const Sec& s : secs) {
        if (s.type != 2 /* SYMTAB */ || s.entsize < 24 || s.link >= secs.size()) continue;
        const Sec& strtab = secs[s.link];
        for (uint64_t o = 0; o + 24 <= s.size; o += s.entsize) {
            uint32_t name;
            uint8_t info;
            memcpy(&name, d + s.off + o, 4);
            info = d[s.off + o + 4];
            if ((info & 15) != 2 /* FUNC */ || (info >> 4) != 1 /* GLOBAL */) continue;
            ImageEntry e;
            e.name = cstr(d, n, strtab.off + name);
            index[e.name] = out->size();
            out->push_back(e);
        }
    }
    // .nv.info.<kernel>: records of {u8 format, u8 attribute, ...}; format 4 carries a u16
    // length and that many bytes. EIATTR_KPARAM_INFO (0x17): u32 index, u16 ordinal,
    // u16 offset, u32 flags whose top 14 bits are the parameter's size in bytes.
    for (const Sec& s : secs) {
        std::string name = cstr(d, n, secs[shstr].off + s.name);
        if (name.compare(0, 9, ".nv.info.") != 0) continue;
        auto it = index.find(name.substr(9));
        if (it == index.end()) continue;
        ImageEntry& e = (*out)[it->second];
        std::map<unsigned, unsigned> by_ordinal;
        uint64_t p = s.off, end = s.off + s.size;
        bool ok = true;
        while (p + 2 <= end && ok) {
            uint8_t fmt = d[p], attr = d[p + 1];
            if (fmt == 4) {
                uint16_t len;
                memcpy(&len, d + p + 2, 2);
                if (attr == 0x17 && len >= 12) {
                    uint16_t ord;
                    uint32_t flags;
                    memcpy(&ord, d + p + 8, 2);
                    memcpy(&flags, d + p + 12, 4);
                    by_ordinal[ord] = flags >> 18;
                }
                p += 4 + (uint64_t)len;
            } else if (fmt == 3 || fmt == 2) {
                p += 4;
            } else if (fmt == 1) {
                p += 2;
            } else {
                ok = false;  // an unknown record format: leave the sizes unknown
            }
        }
        if (!ok) continue;
        e.sizes_known = true;
        for (unsigned i = 0; i < by_ordinal.size(); i++) {
            auto o = by_ordinal.find(i);
            if (o == by_ordinal.end()) {
                e.sizes_known = false;
                break;
            }
            e.param_sizes.push_back(o->second);
        }
    }
    return "";
}

unsigned ptx_type_bytes(const std::string& t) {
    if (t.size() < 3) return 0;
    return (unsigned)atoi(t.c_str() + 2) / 8;  // .u64 .s32 .f32 .b8 ...
}

std::string parse_ptx(const char* text, std::vector<ImageEntry>* out) {
    std::string s(text);
    if (s.find(".version") == std::string::npos || s.find(".target") == std::string::npos)
        return "neither a cubin nor PTX text (no .version / .target)";
    size_t at = 0;
    while ((at = s.find(".entry", at)) != std::string::npos) {
        at += 6;
        size_t b = s.find_first_not_of(" \t", at), e = s.find_first_of(" \t(\n", b);
        if (b == std::string::npos || e == std::string::npos) break;
        ImageEntry en;
        en.name = s.substr(b, e - b);
        size_t open = s.find('(', e), close = s.find(')', e);
        if (open != std::string::npos && close != std::string::npos && open < close) {
            en.sizes_known = true;
            std::string params = s.substr(open + 1, close - open - 1);
            size_t p = 0;
            while ((p = params.find(".param", p)) != std::string::npos) {
                size_t q = params.find_first_of(",", p);
                std::string decl = params.substr(p, q == std::string::npos ? std::string::npos : q - p);
                p += 6;
                // ".param .u64 name" or ".param .align 8 .b8 name[16]"
                size_t lb = decl.find('['), ty = decl.find(" .", 6);
                unsigned bytes = 0;
                if (ty != std::string::npos) {
                    size_t te = decl.find_first_of(" \t", ty + 1);
                    std::string t = decl.substr(ty + 1, te - ty - 1);
                    if (t == ".align") {
                        size_t t2 = decl.find(" .", te);
                        size_t t2e = decl.find_first_of(" \t", t2 + 1);
                        t = decl.substr(t2 + 1, t2e - t2 - 1);
                    }
                    bytes = ptx_type_bytes(t);
                    if (lb != std::string::npos) bytes *= (unsigned)atoi(decl.c_str() + lb + 1);
                }
                en.param_sizes.push_back(bytes);
            }
        }
        out->push_back(en);
    }
    return "";
}

}  // namespace

std::string parse_module_image(const void* image, std::vector<ImageEntry>* out, std::string* kind) {
    const uint8_t* d = (const uint8_t*)image;
    if (!d) return "no image";
    if (memcmp(d, "\x7f" "ELF", 4) == 0) {
        *kind = "cubin";
        return parse_cubin(d, elf_extent(d), out);
    }
    *kind = "PTX";
    return parse_ptx((const char*)image, out);
}

std::vector<TlsSymbol> tls_symbols(const char* path) {
    std::vector<TlsSymbol> syms;
    std::ifstream f(path, std::ios::binary);
    std::vector<uint8_t> d((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (d.size() < 64 || memcmp(d.data(), "\x7f" "ELF", 4) != 0) return syms;
    std::vector<Sec> secs;
    uint16_t shstr = 0;
    if (!sections(d.data(), d.size(), &secs, &shstr).empty()) return syms;
    for (const Sec& s : secs) {
        if (s.type != 2 || s.entsize < 24 || s.link >= secs.size()) continue;
        for (uint64_t o = 0; o + 24 <= s.size; o += s.entsize) {
            const uint8_t* e = d.data() + s.off + o;
            uint32_t name;
            uint64_t value, size;
            memcpy(&name, e, 4);
            memcpy(&value, e + 8, 8);
            memcpy(&size, e + 16, 8);
            if ((e[4] & 15) != 6 /* TLS */ || size == 0) continue;
            syms.push_back({value, size, cstr(d.data(), d.size(), secs[s.link].off + name)});
        }
    }
    return syms;
}

}  // namespace tsim
