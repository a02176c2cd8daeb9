"""Reference fixtures for the kernels' quantized formats (kernels/tests/quant_reference.rs).

For each block-quantized type Tandem multiplies: a row of blocks with pseudo-random bytes
(every bit pattern of codes, scales and high bits; sane f16 super-scales, one of them 0),
the values gguf-py's numpy dequantization (`gguf.quants.dequantize`, an implementation
independent of Tandem's) gives them, a row of activations, those activations quantized
the way Tandem defines its activation blocks (kernels/src/quant/mod.rs), and the exactly
rounded dot product of the dequantized weights with the dequantized activations.

Deterministic without numpy's random generators (whose streams may change between
versions): bytes come from SplitMix64, sums from math.fsum.

    .venv/bin/python scripts/quant_reference.py > kernels/tests/fixtures/quant_reference.json

`make kernel-fixtures-check` (part of `make test`) regenerates it and fails on any difference.
"""
import json
import math
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

MASK = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed: int):
        self.s = seed & MASK

    def next(self) -> int:
        self.s = (self.s + 0x9E3779B97F4A7C15) & MASK
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def bytes(self, n: int) -> bytes:
        return bytes(self.next() & 0xFF for _ in range(n))

    def unit(self) -> float:
        """Uniform in [-1, 1) with 24 bits, exact in f32."""
        return (self.next() >> 40) / float(1 << 24) * 2.0 - 1.0


# (type, blocks per row, byte offsets of its f16 super-scales)
TYPES = [
    (T.Q8_0, 4, [0]),
    (T.Q4_0, 4, [0]),
    (T.Q4_1, 4, [0, 2]),
    (T.Q5_0, 4, [0]),
    (T.Q5_1, 4, [0, 2]),
    (T.Q4_K, 2, [0, 2]),
    (T.Q5_K, 2, [0, 2]),
    (T.Q6_K, 2, [208]),
]
K_TYPES = {T.Q4_K, T.Q5_K, T.Q6_K}


def f16_bytes(v: float) -> bytes:
    return np.array([v], dtype=np.float16).tobytes()


def weights(rng: SplitMix64, qtype, n_blocks: int, scale_offsets) -> bytes:
    block_len, block_bytes = GGML_QUANT_SIZES[qtype]
    out = bytearray()
    for b in range(n_blocks):
        blk = bytearray(rng.bytes(block_bytes))
        for i, off in enumerate(scale_offsets):
            # A super-scale of order 1e-2 (a real model's), negative now and then; the
            # first block of each type has its last scale 0 (a degenerate block).
            v = (rng.unit() * 0.02) if not (b == 0 and i == len(scale_offsets) - 1) else 0.0
            blk[off:off + 2] = f16_bytes(v)
        out += blk
    return bytes(out)


def activations(rng: SplitMix64, n: int) -> np.ndarray:
    x = np.array([rng.unit() * 3.0 for _ in range(n)], dtype=np.float32)
    x[:16] = 0.0  # a run of zeros inside a block
    x[20] = np.float32(-7.25)  # a negative extreme
    return x


def quantize_q8(x: np.ndarray):
    """Tandem's BlockQ8: per 32, d = amax / 127, id = 1 / d, q = rint(clip(x·id)), s = d·Σq."""
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(np.clip(blocks * idv[:, None], -127, 127)).astype(np.int8)
    s = (d * q.astype(np.int32).sum(axis=1).astype(np.float32)).astype(np.float32)
    return d, q, s


def quantize_q8k(x: np.ndarray):
    """Tandem's BlockQ8K: per 256, id = 127 / amax, d = 1 / id, q = rint(clip(x·id)),
    sums of each 16 codes."""
    blocks = x.reshape(-1, 256)
    amax = np.abs(blocks).max(axis=1).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        d = np.where(idv != 0, np.float32(1) / idv, np.float32(0)).astype(np.float32)
    q = np.rint(np.clip(blocks * idv[:, None], -127, 127)).astype(np.int8)
    sums = q.astype(np.int16).reshape(-1, 16, 16).sum(axis=2).astype(np.int16)
    return d, q, sums


def main() -> None:
    rng = SplitMix64(19)
    out = []
    for qtype, n_blocks, offsets in TYPES:
        block_len, _ = GGML_QUANT_SIZES[qtype]
        n = n_blocks * block_len
        w = weights(rng, qtype, n_blocks, offsets)
        values = dequantize(np.frombuffer(w, dtype=np.uint8), qtype).astype(np.float32).reshape(-1)
        assert values.shape == (n,) and np.isfinite(values).all()
        x = activations(rng, n)
        if qtype in K_TYPES:
            d, q, sums = quantize_q8k(x)
            act = {"format": "Q8K", "d": d.tobytes().hex(), "qs": q.tobytes().hex(),
                   "bsums": sums.astype("<i2").tobytes().hex()}
            a = (q.astype(np.float32) * d[:, None]).reshape(-1)
        else:
            d, q, s = quantize_q8(x)
            act = {"format": "Q8", "d": d.tobytes().hex(), "qs": q.tobytes().hex(),
                   "s": s.tobytes().hex()}
            a = (q.astype(np.float32) * d[:, None]).reshape(-1)
        prods = [float(wv) * float(av) for wv, av in zip(values, a)]
        out.append({
            "type": qtype.name,
            "id": int(qtype.value),
            "n": n,
            "weights": w.hex(),
            "values": values.astype("<f4").tobytes().hex(),
            "x": x.astype("<f4").tobytes().hex(),
            "act": act,
            "dot": math.fsum(prods),
            "mag": math.fsum(abs(p) for p in prods),
        })
    json.dump({"generator": "scripts/quant_reference.py", "types": out}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
