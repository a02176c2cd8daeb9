//! CRC-32C (Castagnoli, reflected, polynomial 0x82F63B78) of KV chunk data. It guards
//! against corruption and mix-ups, not against an attacker (the handshake does that).
//!
//! CRC-32C rather than the IEEE CRC-32 because x86-64 computes it in hardware (SSE4.2
//! `crc32`, 8 bytes per instruction); elsewhere, or without SSE4.2, a table-driven
//! "slicing by 8" computes the same value.

/// Lookup tables for "slicing by 8": `T[0]` is the classic byte-at-a-time table; `T[k]`
/// advances a byte's contribution through k more zero bytes, so eight input bytes are
/// folded per step with eight independent lookups.
const fn tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0x82F6_3B78 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut s = 1;
    while s < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[s - 1][i];
            t[s][i] = (prev >> 8) ^ t[0][(prev & 0xFF) as usize];
            i += 1;
        }
        s += 1;
    }
    t
}

static T: [[u32; 256]; 8] = tables();

/// CRC-32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // The one unsafe call: a `target_feature` function may only be called where
            // the CPU has the feature.
            // SAFETY: the CPU supports SSE4.2, checked just above.
            #[allow(unsafe_code)]
            return unsafe { !hw::update(!0, data) };
        }
    }
    !table_update(!0, data)
}

fn table_update(mut c: u32, data: &[u8]) -> u32 {
    let mut blocks = data.chunks_exact(8);
    for b in &mut blocks {
        let lo = c ^ u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        c = T[7][(lo & 0xFF) as usize]
            ^ T[6][((lo >> 8) & 0xFF) as usize]
            ^ T[5][((lo >> 16) & 0xFF) as usize]
            ^ T[4][(lo >> 24) as usize]
            ^ T[3][b[4] as usize]
            ^ T[2][b[5] as usize]
            ^ T[1][b[6] as usize]
            ^ T[0][b[7] as usize];
    }
    for &b in blocks.remainder() {
        c = T[0][((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8);
    }
    c
}

#[cfg(target_arch = "x86_64")]
mod hw {
    use std::arch::x86_64::{_mm_crc32_u8, _mm_crc32_u64};

    /// Bytes per independent stream: the `crc32` instruction has a latency of 3 cycles
    /// and a throughput of 1 per cycle, so three streams run in parallel and are then
    /// combined with [`shift`] (multiplication by x^(8·LANE) modulo the polynomial).
    const LANE: usize = 8192;

    #[target_feature(enable = "sse4.2")]
    pub(super) fn update(mut c: u32, data: &[u8]) -> u32 {
        let mut rest = data;
        while rest.len() >= 3 * LANE {
            let (a, tail) = rest.split_at(LANE);
            let (b, tail) = tail.split_at(LANE);
            let (d, tail) = tail.split_at(LANE);
            let (mut ca, mut cb, mut cd) = (c as u64, 0u64, 0u64);
            for i in (0..LANE).step_by(8) {
                ca = _mm_crc32_u64(ca, word(a, i));
                cb = _mm_crc32_u64(cb, word(b, i));
                cd = _mm_crc32_u64(cd, word(d, i));
            }
            // crc(A‖B) = shift(crc(A), |B|) ^ crc0(B), where crc0 starts from 0.
            let ab = shift(ca as u32) ^ cb as u32;
            c = shift(ab) ^ cd as u32;
            rest = tail;
        }
        let mut words = rest.chunks_exact(8);
        let mut c64 = c as u64;
        for w in &mut words {
            c64 = _mm_crc32_u64(c64, word(w, 0));
        }
        let mut c = c64 as u32;
        for &b in words.remainder() {
            c = _mm_crc32_u8(c, b);
        }
        c
    }

    #[inline(always)]
    fn word(b: &[u8], i: usize) -> u64 {
        u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
    }

    /// `c · x^(8·LANE) mod P` in the reflected domain: the CRC register after feeding
    /// LANE zero bytes with no pre/post inversion (linear in `c`, so a table of the 32
    /// single-bit images suffices).
    fn shift(c: u32) -> u32 {
        static IMAGES: std::sync::OnceLock<[u32; 32]> = std::sync::OnceLock::new();
        let m = IMAGES.get_or_init(|| {
            let zeros = [0u8; LANE];
            std::array::from_fn(|bit| super::table_update(1u32 << bit, &zeros))
        });
        let mut out = 0;
        for (bit, img) in m.iter().enumerate() {
            if c >> bit & 1 != 0 {
                out ^= img;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    fn bitwise(data: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in data {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
        }
        !c
    }

    #[test]
    fn standard_check_values() {
        // The catalogue check value of CRC-32C, and the empty input.
        assert_eq!(super::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(super::crc32c(b""), 0);
        assert_ne!(super::crc32c(b"a"), super::crc32c(b"b"));
    }

    /// The table path and the dispatching entry point (hardware where available, with its
    /// three-stream combination) equal the plain bitwise definition at every length
    /// class, including lengths around the three-lane block size.
    #[test]
    fn fast_paths_equal_bitwise_definition() {
        let data: Vec<u8> = (0..100_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for n in (0..40).chain([
            255, 256, 257, 999, 1000, 24_575, 24_576, 24_583, 49_160, 100_000,
        ]) {
            let want = bitwise(&data[..n]);
            assert_eq!(super::crc32c(&data[..n]), want, "length {n}");
            assert_eq!(
                !super::table_update(!0, &data[..n]),
                want,
                "table, length {n}"
            );
        }
    }
}
