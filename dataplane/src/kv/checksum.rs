//! CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320) of KV chunk data. It guards
//! against corruption and mix-ups, not against an attacker (the handshake does that).

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
                0xEDB8_8320 ^ (c >> 1)
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

pub fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
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
    !c
}

#[cfg(test)]
mod tests {
    #[test]
    fn standard_check_values() {
        // The catalogue check value of CRC-32/ISO-HDLC, and the empty input.
        assert_eq!(super::crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(super::crc32(b""), 0);
        assert_ne!(super::crc32(b"a"), super::crc32(b"b"));
    }

    /// The 8-byte fast path equals the plain bitwise definition at every length and
    /// alignment of the tail.
    #[test]
    fn sliced_equals_bitwise_definition() {
        fn bitwise(data: &[u8]) -> u32 {
            let mut c = !0u32;
            for &b in data {
                c ^= b as u32;
                for _ in 0..8 {
                    c = if c & 1 != 0 {
                        0xEDB8_8320 ^ (c >> 1)
                    } else {
                        c >> 1
                    };
                }
            }
            !c
        }
        let data: Vec<u8> = (0..1000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for n in (0..40).chain([255, 256, 257, 999, 1000]) {
            assert_eq!(super::crc32(&data[..n]), bitwise(&data[..n]), "length {n}");
        }
    }
}
