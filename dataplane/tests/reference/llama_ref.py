#!/usr/bin/env python3
"""Independent numpy reference forward pass of a GGUF model of the architectures Tandem
serves: llama (with Llama 3.1's rope_freqs and linear RoPE scaling), qwen2 (Q/K/V biases),
qwen3 (per-head Q/K RMS norms), gemma3 (embedding scale, Q/K norms, sandwich norms, GeGLU
with tanh GELU, sliding-window layers with their own RoPE base).

Shares no code with the Rust engine. Tensors are read with the PyPI `gguf` package as raw
bytes; dequantization follows the GGUF block definitions directly:
  Q8_0: f16 d, 32 x i8 q                 -> q * d
  Q4_0: f16 d, 16 bytes (lo nibble = element j, hi nibble = element j+16) -> (q - 8) * d
  Q4_1: f16 d, f16 m, 16 bytes as Q4_0    -> q * d + m
  F32 / F16 / BF16 as stored;
every other block type (Q5_0, Q5_1, the K-quants) through the `gguf` package's own
dequantizer (`gguf.quants.dequantize`, written from ggml's block layouts, not Tandem's).

Numerics mirror what a llama.cpp-style CPU engine computes, so that greedy tokens can be
compared exactly: for block-quantized weights the activations are quantized per 32-block
to int8 (d = amax/127, q = round-half-even(x * (1/d))) before the product; float weights
multiply f32 activations. K/V are rounded to the cache dtype before use.

The architecture is read from `general.architecture` (its RoPE style, activation and
optional tensors as llama.cpp defines them); what a file carries (biases, norms, windows,
factors) is taken from its tensors and metadata.

Usage: llama_ref.py MODEL.gguf --prompts '[[1,2,3],[4,5]]' --n-gen 32 --logits OUT.f32
Prints {"tokens": [[...], ...]} as JSON; OUT.f32 holds float32 logits, shape
[n_prompts, n_gen, vocab] (the distribution each generated token was chosen from).
"""
import argparse
import json
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
QK = 32
ACT_Q8 = True


def f16(raw):
    return raw.view(np.float16).astype(np.float32)


class QWeight:
    """A block-quantized matrix, dequantized once to f32 [rows, cols]."""

    def __init__(self, ty, raw, rows, cols):
        nb = cols // QK
        if ty == Q8_0:
            b = raw.reshape(rows, nb, 34)
            d = f16(b[:, :, 0:2].copy())
            w = b[:, :, 2:].copy().view(np.int8).astype(np.float32) * d
        else:
            off = 2 if ty == Q4_0 else 4
            b = raw.reshape(rows, nb, off + 16)
            d = f16(b[:, :, 0:2].copy())
            nib = b[:, :, off:]
            codes = np.concatenate([nib & 0x0F, nib >> 4], axis=2).astype(np.float32)
            if ty == Q4_0:
                w = (codes - 8.0) * d
            else:
                w = codes * d + f16(b[:, :, 2:4].copy())
        self.w = w.reshape(rows, cols).astype(np.float32)

    def row_f32(self, r):
        return self.w[r]

    def __call__(self, x):
        if not ACT_Q8:
            return (x @ self.w.T).astype(np.float32)
        # Quantize-dequantize the activations per 32-block exactly as the engine quantizes
        # them. Then sum_b d_w*d_a*sum_j(q_w*q_a) (+ m*d_a*sum_j q_a) equals
        # (W_deq @ x_deq) up to f32 rounding, so one BLAS matmul does the integer math.
        return (q8_round_trip(x) @ self.w.T).astype(np.float32)


def q8_round_trip(x):
    """Quantize-dequantize the last axis per 32-block as the engine quantizes activations
    (scale amax/127, round half to even)."""
    xb = x.reshape(*x.shape[:-1], -1, QK)
    da = (np.abs(xb).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    ida = np.where(da != 0, np.float32(1.0) / np.where(da != 0, da, 1), 0).astype(np.float32)
    qa = np.clip(np.rint(xb * ida[..., None]), -127, 127).astype(np.float32)
    return (qa * da[..., None]).reshape(x.shape).astype(np.float32)


K_QUANTS = (10, 11, 12, 13, 14)  # Q2_K .. Q6_K


class GWeight(QWeight):
    """Any other block type, dequantized by the gguf package. Q5_0/Q5_1 multiply Q8
    activations (32 per scale, as Q4_0); the K-quants multiply Q8_K activations: 256 per
    scale, iscale = 127/amax, d = 1/iscale (ggml's quantize_row_q8_K)."""

    def __init__(self, ty, raw, rows, cols):
        self.ty = ty
        self.w = dequantize(raw.reshape(rows, -1), GGMLQuantizationType(ty)).astype(np.float32)
        assert self.w.shape == (rows, cols), (self.w.shape, rows, cols)

    def __call__(self, x):
        if not ACT_Q8:
            return (x @ self.w.T).astype(np.float32)
        if self.ty in K_QUANTS:
            return (q8k_round_trip(x) @ self.w.T).astype(np.float32)
        return (q8_round_trip(x) @ self.w.T).astype(np.float32)


def q8k_round_trip(x):
    """Quantize-dequantize the last axis per 256-block as Q8_K."""
    xb = x.reshape(*x.shape[:-1], -1, 256)
    amax = np.abs(xb).max(axis=-1)
    iscale = np.where(amax != 0, np.float32(127.0) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    d = np.where(iscale != 0, np.float32(1.0) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    q = np.clip(np.rint(np.clip(xb * iscale[..., None], -127, 127)), -127, 127).astype(np.float32)
    return (q * d[..., None]).reshape(x.shape).astype(np.float32)


class FWeight:
    def __init__(self, ty, raw, rows, cols):
        if ty == F32:
            w = raw.view(np.float32)
        elif ty == F16:
            w = f16(raw)
        elif ty == BF16:
            w = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            sys.exit(f"unsupported tensor type {ty}")
        self.w = w.reshape(rows, cols).astype(np.float32)

    def row_f32(self, r):
        return self.w[r]

    def __call__(self, x):
        return (x @ self.w.T).astype(np.float32)


def round_kv(x, dtype):
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "q8_0":
        b = x.reshape(-1, QK)
        d = (np.abs(b).max(axis=1) / np.float32(127.0)).astype(np.float32)
        idv = np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, 1), 0).astype(np.float32)
        q = np.clip(np.rint(b * idv[:, None]), -127, 127)
        d16 = d.astype(np.float16).astype(np.float32)
        return (q * d16[:, None]).reshape(x.shape).astype(np.float32)
    sys.exit(f"unknown kv dtype {dtype}")


# Per architecture: RoPE style, FFN activation, embedding scale, sliding-window period and
# the sliding layers' RoPE base (llama.cpp's definitions of these families).
ARCHS = {
    "llama": dict(rope="normal", act="silu", embed_scale=False, swa=None),
    "qwen2": dict(rope="neox", act="silu", embed_scale=False, swa=None),
    "qwen3": dict(rope="neox", act="silu", embed_scale=False, swa=None),
    "gemma3": dict(rope="neox", act="gelu_tanh", embed_scale=True, swa=(6, 10000.0)),
}


class Model:
    def __init__(self, path, kv_dtype, rope_style):
        r = GGUFReader(path)
        meta = {k: f.contents() for k, f in r.fields.items()}
        arch = meta["general.architecture"]
        if arch not in ARCHS:
            sys.exit(f"architecture {arch} is not modelled here")
        spec = ARCHS[arch]
        g = lambda k, d=None: meta.get(f"{arch}." + k, d)
        self.n_layers = int(g("block_count"))
        self.dim = int(g("embedding_length"))
        self.n_heads = int(g("attention.head_count"))
        self.n_kv = int(g("attention.head_count_kv", self.n_heads))
        self.hd = int(g("attention.key_length", self.dim // self.n_heads))
        self.rope_dim = int(g("rope.dimension_count", self.hd))
        self.eps = np.float32(g("attention.layer_norm_rms_epsilon"))
        self.vocab = len(meta["tokenizer.ggml.tokens"])
        self.kv_dtype = kv_dtype
        self.rope_style = rope_style or spec["rope"]
        self.act = spec["act"]
        self.embed_scale = np.float32(np.sqrt(self.dim)) if spec["embed_scale"] else None
        scaling = g("rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            sys.exit(f"rope scaling {scaling} is not modelled here")
        global_scale = 1.0 / float(g("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        global_base = float(g("rope.freq_base", 10000.0))
        # Per layer: (window or None, rope base, frequency scale, use rope_freqs).
        window = int(g("attention.sliding_window", 0) or 0)
        self.layer_spec = []
        for il in range(self.n_layers):
            if spec["swa"] and window > 0:
                period, local_base = spec["swa"]
                pattern = g("attention.sliding_window_pattern", period)
                if isinstance(pattern, list):
                    sliding = bool(pattern[il])
                else:
                    period = int(pattern)
                    sliding = period == 0 or il % period < period - 1
            else:
                sliding = False
            if sliding:
                self.layer_spec.append((window, float(g("rope.freq_base_swa", local_base)), 1.0, False))
            else:
                self.layer_spec.append((None, global_base, global_scale, True))
        tensors = {t.name: t for t in r.tensors}

        def load(name):
            t = tensors[name]
            raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
            ty = int(t.tensor_type)
            shape = [int(s) for s in t.shape]
            cols = shape[0]
            rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            if ty in (Q4_0, Q4_1, Q8_0):
                return QWeight(ty, raw, rows, cols)
            if ty in (F32, F16, BF16):
                return FWeight(ty, raw, rows, cols)
            return GWeight(ty, raw, rows, cols)

        vec = lambda name: load(name).row_f32(0)
        opt = lambda name: vec(name) if name in tensors else None
        self.embd = load("token_embd.weight")
        self.out = load("output.weight") if "output.weight" in tensors else self.embd
        self.out_norm = vec("output_norm.weight")
        self.rope_freqs = opt("rope_freqs.weight")
        self.layers = []
        for i in range(self.n_layers):
            p = f"blk.{i}."
            L = {k: (vec if "norm" in k else load)(p + k + ".weight") for k in
                 ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]}
            for k in ["attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias",
                      "attn_q_norm.weight", "attn_k_norm.weight",
                      "post_attention_norm.weight", "post_ffw_norm.weight"]:
                L[k] = opt(p + k)
            self.layers.append(L)

    def rmsnorm(self, x, w):
        """Row-wise over the last axis (rows of w's length)."""
        ms = (x * x).mean(axis=-1, keepdims=True, dtype=np.float32)
        return (x / np.sqrt(ms + self.eps) * w).astype(np.float32)

    def head_norm(self, x, w, n_heads):
        t = x.shape[0]
        return self.rmsnorm(x.reshape(t, n_heads, self.hd), w).reshape(t, -1)

    def rope(self, x, pos, n_heads, base, scale, factors):
        # x: [t, n_heads * hd]; rotate the first rope_dim dims of each head.
        t = x.shape[0]
        h = x.reshape(t, n_heads, self.hd).copy()
        half = self.rope_dim // 2
        freq = base ** (-2.0 * np.arange(half, dtype=np.float64) / self.rope_dim) * scale
        if factors is not None:
            freq = freq / factors.astype(np.float64)
        ang = np.asarray(pos, dtype=np.float64)[:, None] * freq[None, :]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        if self.rope_style == "normal":
            a, b = h[:, :, 0:self.rope_dim:2].copy(), h[:, :, 1:self.rope_dim:2].copy()
            h[:, :, 0:self.rope_dim:2] = a * cos - b * sin
            h[:, :, 1:self.rope_dim:2] = a * sin + b * cos
        else:
            a, b = h[:, :, :half].copy(), h[:, :, half:self.rope_dim].copy()
            h[:, :, :half] = a * cos - b * sin
            h[:, :, half:self.rope_dim] = a * sin + b * cos
        return h.reshape(t, -1)

    def ffn_act(self, gt):
        if self.act == "silu":
            return gt / (np.float32(1.0) + np.exp(-gt))
        c = np.float32(np.sqrt(2.0 / np.pi))
        return np.float32(0.5) * gt * (np.float32(1.0) + np.tanh(c * (gt + np.float32(0.044715) * gt * gt * gt)))

    def forward(self, seqs, cache):
        """seqs: list of (seq index, [tokens]); returns last-position logits per seq."""
        toks = [tk for _, ts in seqs for tk in ts]
        pos = [len(cache[s][0][0]) + j for s, ts in seqs for j in range(len(ts))]
        x = np.stack([self.embd.row_f32(t) for t in toks]).astype(np.float32)
        if self.embed_scale is not None:
            x = (x * self.embed_scale).astype(np.float32)
        g = self.n_heads // self.n_kv
        hd = self.hd
        plus = lambda y, b: y if b is None else (y + b).astype(np.float32)
        post = lambda y, w: y if w is None else self.rmsnorm(y, w)
        for li, L in enumerate(self.layers):
            window, base, scale, use_factors = self.layer_spec[li]
            factors = self.rope_freqs if use_factors else None
            h = self.rmsnorm(x, L["attn_norm"])
            q = plus(L["attn_q"](h), L["attn_q.bias"])
            k = plus(L["attn_k"](h), L["attn_k.bias"])
            v = plus(L["attn_v"](h), L["attn_v.bias"])
            if L["attn_q_norm.weight"] is not None:
                q = self.head_norm(q, L["attn_q_norm.weight"], self.n_heads)
                k = self.head_norm(k, L["attn_k_norm.weight"], self.n_kv)
            q = self.rope(q, pos, self.n_heads, base, scale, factors)
            k = round_kv(self.rope(k, pos, self.n_kv, base, scale, factors), self.kv_dtype)
            v = round_kv(v, self.kv_dtype)
            att = np.zeros_like(q)
            row = 0
            for s, ts in seqs:
                n = len(ts)
                kc, vc = cache[s][li]
                kc.extend(k[row:row + n])
                vc.extend(v[row:row + n])
                K = np.stack(kc).reshape(-1, self.n_kv, hd)
                V = np.stack(vc).reshape(-1, self.n_kv, hd)
                start = len(kc) - n
                for j in range(n):
                    ctx = start + j + 1
                    lo = max(0, ctx - window) if window else 0
                    qh = q[row + j].reshape(self.n_kv, g, hd)
                    sc = np.einsum("kgd,tkd->kgt", qh, K[lo:ctx]) / np.float32(np.sqrt(hd))
                    sc = np.exp(sc - sc.max(axis=2, keepdims=True))
                    sc = sc / sc.sum(axis=2, keepdims=True)
                    att[row + j] = np.einsum("kgt,tkd->kgd", sc, V[lo:ctx]).reshape(-1)
                row += n
            o = plus(L["attn_output"](att.astype(np.float32)), L["attn_output.bias"])
            x = x + post(o, L["post_attention_norm.weight"])
            h = self.rmsnorm(x, L["ffn_norm"])
            gt, up = L["ffn_gate"](h), L["ffn_up"](h)
            act = (self.ffn_act(gt) * up).astype(np.float32)
            x = x + post(L["ffn_down"](act), L["post_ffw_norm.weight"])
        last, row = [], 0
        for _, ts in seqs:
            row += len(ts)
            last.append(x[row - 1])
        hidden = self.rmsnorm(np.stack(last), self.out_norm)
        return self.out(hidden)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--kv-dtype", default="f16", choices=["f32", "f16", "q8_0"])
    ap.add_argument("--rope", default=None, choices=["normal", "neox"],
                    help="override the architecture's RoPE style")
    ap.add_argument("--act", default="q8", choices=["q8", "f32"],
                    help="q8: quantize activations per block like the engine; f32: exact")
    ap.add_argument("--logits", help="write float32 logits [n_prompts, n_gen, vocab] here")
    a = ap.parse_args()
    global ACT_Q8
    ACT_Q8 = a.act == "q8"
    m = Model(a.model, a.kv_dtype, a.rope)
    prompts = json.loads(a.prompts)
    cache = [[([], []) for _ in range(m.n_layers)] for _ in prompts]
    all_logits = np.zeros((len(prompts), a.n_gen, m.vocab), dtype=np.float32)
    out = [[] for _ in prompts]
    for i, p in enumerate(prompts):  # prompts prefill one by one (different lengths)
        all_logits[i, 0] = m.forward([(i, p)], cache)[0]
        out[i].append(int(np.argmax(all_logits[i, 0])))
    for step in range(1, a.n_gen):  # decode all sequences together
        lg = m.forward([(i, [out[i][-1]]) for i in range(len(prompts))], cache)
        for i in range(len(prompts)):
            all_logits[i, step] = lg[i]
            out[i].append(int(np.argmax(lg[i])))
    if a.logits:
        all_logits.tofile(a.logits)
    print(json.dumps({"tokens": out}))


if __name__ == "__main__":
    main()
