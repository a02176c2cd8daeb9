//! Codec properties: every message round-trips, and no byte sequence makes decoding panic
//! (each failure is a typed error with a kind label).

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::chunks::{Assembler, BufferPool, ChunkError, POOL_BYTES, split};
use super::*;
use crate::sampling::SamplingParams;

fn layout() -> impl Strategy<Value = KvLayout> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(|(dtype, layers, kv_heads, head_dim, block_size)| KvLayout {
            dtype,
            layers,
            kv_heads,
            head_dim,
            block_size,
        })
}

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 _é]{0,40}"
}

fn finite() -> impl Strategy<Value = f32> {
    -1e6f32..1e6f32
}

/// Sampling parameters within every limit (`sampling::limits`), counts within `u32`.
fn sampling() -> impl Strategy<Value = SamplingParams> {
    (
        (
            0.0f32..=2.0,
            any::<u32>(),
            1e-6f32..=1.0,
            any::<Option<u64>>(),
        ),
        proptest::option::of(0usize..=20),
        (0.01f32..10.0, -2.0f32..=2.0, -2.0f32..=2.0),
        any::<u32>(),
        prop::collection::vec(any::<u32>(), 0..8),
    )
        .prop_map(
            |((temperature, top_k, top_p, seed), logprobs, pen, min_tokens, masked)| {
                SamplingParams {
                    temperature,
                    top_k: top_k as usize,
                    top_p,
                    seed,
                    logprobs,
                    repetition_penalty: pen.0,
                    frequency_penalty: pen.1,
                    presence_penalty: pen.2,
                    min_tokens: min_tokens as usize,
                    min_tokens_masked: masked,
                }
            },
        )
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (text(), layout(), any::<[u8; 32]>()).prop_map(|(fingerprint, layout, nonce)| {
            Message::Hello {
                fingerprint,
                layout,
                nonce,
            }
        }),
        (text(), layout(), any::<[u8; 32]>(), any::<[u8; 32]>()).prop_map(
            |(fingerprint, layout, nonce, mac)| Message::Welcome {
                fingerprint,
                layout,
                nonce,
                mac
            }
        ),
        any::<[u8; 32]>().prop_map(|mac| Message::Auth { mac }),
        Just(Message::Accepted),
        (prop::sample::select(RejectReason::ALL), text())
            .prop_map(|(reason, text)| Message::Reject { reason, text }),
        (
            prop::collection::vec(any::<u32>(), 1..64),
            sampling(),
            any::<u32>(),
        )
            .prop_map(|(tokens, sampling, c)| {
                let cached_tokens = c % tokens.len() as u32;
                Message::Prefill(PrefillRequest {
                    tokens,
                    sampling,
                    cached_tokens,
                })
            }),
        (
            prop::collection::vec(any::<u8>(), 0..256),
            0u32..4,
            any::<u16>(),
            0u64..1000
        )
            .prop_map(|(data, index, layer, offset)| {
                Message::KvChunk(KvChunk {
                    index,
                    count: index + 1,
                    first_layer: layer / 2,
                    end_layer: layer / 2 + 1,
                    offset,
                    total: offset + data.len() as u64 + 5,
                    crc32: checksum::crc32c(&data),
                    data,
                })
            }),
        (
            any::<u32>(),
            any::<u32>(),
            proptest::option::of((
                finite(),
                prop::collection::vec((any::<u32>(), finite()), 0..21)
            ))
        )
            .prop_map(|(first_token, prompt_tokens, lp)| Message::Done {
                first_token,
                prompt_tokens,
                logprob: lp.map(|(logprob, top)| WireLogprob { logprob, top }),
            }),
        (prop::sample::select(FailCode::ALL), text())
            .prop_map(|(reason, text)| Message::Failed { reason, text }),
        Just(Message::Abort),
        Just(Message::AbortAck),
        (any::<u64>(), any::<u64>()).prop_map(|(nonce, timestamp_us)| Message::Ping {
            nonce,
            timestamp_us
        }),
        (any::<u64>(), any::<u64>()).prop_map(|(nonce, timestamp_us)| Message::Pong {
            nonce,
            timestamp_us
        }),
        (any::<u32>(), any::<u32>()).prop_map(|(done, total)| Message::Progress { done, total }),
        any::<u64>().prop_map(|consumed| Message::Credit { consumed }),
        (prop::sample::select(FailCode::ALL), text())
            .prop_map(|(reason, text)| Message::Goodbye { reason, text }),
    ]
}

fn envelope() -> impl Strategy<Value = Envelope> {
    (message(), any::<u64>(), any::<u64>(), 1u64..).prop_map(|(msg, inc, group, room)| {
        let room = if matches!(
            msg.msg_type(),
            MsgType::Prefill
                | MsgType::KvChunk
                | MsgType::Done
                | MsgType::Failed
                | MsgType::Abort
                | MsgType::AbortAck
                | MsgType::Progress
        ) {
            room
        } else {
            0
        };
        Envelope {
            incarnation: inc,
            group_incarnation: group,
            room,
            msg,
        }
    })
}

fn decode2(f: &[Vec<u8>]) -> Result<Envelope, DecodeError> {
    let refs: Vec<&[u8]> = f.iter().map(Vec::as_slice).collect();
    decode(&refs)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_message_round_trips(env in envelope()) {
        let frames = encode(&env);
        prop_assert_eq!(frames[0].len(), HEADER_LEN);
        prop_assert_eq!(decode2(&frames), Ok(env));
    }

    #[test]
    fn mutated_encodings_decode_or_fail_typed(
        env in envelope(),
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        which in 0usize..2,
    ) {
        let mut frames = encode(&env).to_vec();
        let f = &mut frames[which];
        for (i, b) in flips {
            if !f.is_empty() {
                let at = i.index(f.len());
                f[at] ^= b;
            }
        }
        if !f.is_empty() {
            let keep = cut.index(f.len() + 1);
            if keep < f.len() / 2 {
                f.truncate(keep);
            }
        }
        if let Err(e) = decode2(&frames) {
            prop_assert!(!e.kind().is_empty());
        }
    }
}

/// 100,000 more cases, cheap enough for CI: random frames, random frame counts, valid
/// headers with random payloads, and every message with its length fields corrupted.
#[test]
fn hundred_thousand_hostile_inputs_never_panic() {
    let mut rng = StdRng::seed_from_u64(0x7A4D);
    let mut kinds = std::collections::BTreeMap::<&str, usize>::new();
    let mut ok = 0usize;
    for case in 0..100_000u32 {
        let frames: Vec<Vec<u8>> = match case % 4 {
            0 => {
                let n = rng.random_range(0..4);
                (0..n)
                    .map(|_| {
                        let len = rng.random_range(0..64);
                        (0..len).map(|_| rng.random()).collect()
                    })
                    .collect()
            }
            1 | 2 => {
                // A valid header for a random type (known or not) and a random payload.
                let t: u8 = rng.random_range(0..16);
                let len = rng.random_range(0..80usize);
                let payload: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                let mut h = MAGIC.to_vec();
                h.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
                h.push(t);
                h.push(0);
                h.extend_from_slice(&rng.random::<u64>().to_le_bytes());
                h.extend_from_slice(&rng.random::<u64>().to_le_bytes());
                let room: u64 = if rng.random() { 0 } else { rng.random() };
                h.extend_from_slice(&room.to_le_bytes());
                let claimed = if case % 4 == 1 {
                    len as u32
                } else {
                    rng.random()
                };
                h.extend_from_slice(&claimed.to_le_bytes());
                vec![h, payload]
            }
            _ => {
                // A real PREFILL whose token count claims far more than is present.
                let env = Envelope {
                    incarnation: 1,
                    group_incarnation: 2,
                    room: 3,
                    msg: Message::Prefill(PrefillRequest {
                        tokens: vec![1, 2, 3],
                        sampling: SamplingParams {
                            temperature: 0.0,
                            ..Default::default()
                        },
                        ..Default::default()
                    }),
                };
                let mut f = encode(&env).to_vec();
                let claim: u32 = rng.random();
                f[1][..4].copy_from_slice(&claim.to_le_bytes());
                f
            }
        };
        match decode2(&frames) {
            Ok(_) => ok += 1,
            Err(e) => *kinds.entry(e.kind()).or_default() += 1,
        }
    }
    // The generator reaches the interesting error kinds, not just one of them.
    for k in [
        "frame_count",
        "bad_magic",
        "unknown_type",
        "truncated",
        "bad_length",
        "bad_room",
    ] {
        assert!(
            kinds.get(k).copied().unwrap_or(0) > 0,
            "{k} never hit: {kinds:?}"
        );
    }
    assert!(ok + kinds.values().sum::<usize>() == 100_000);
}

#[test]
fn wrong_version_is_recognised_before_the_rest_of_the_header() {
    let env = Envelope {
        incarnation: 5,
        group_incarnation: 6,
        room: 0,
        msg: Message::Accepted,
    };
    let mut f = encode(&env).to_vec();
    f[0][4..6].copy_from_slice(&9u16.to_le_bytes());
    f[0].truncate(8);
    assert_eq!(
        decode2(&f),
        Err(DecodeError::WrongVersion {
            got: 9,
            want: PROTOCOL_VERSION,
            msg_type: MsgType::Accepted as u8
        })
    );
    // Oversized payloads are refused by size before anything else is read.
    let big = vec![0u8; MAX_PAYLOAD + 1];
    let mut h = encode(&env)[0].clone();
    h[32..36].copy_from_slice(&((MAX_PAYLOAD + 1) as u32).to_le_bytes());
    assert_eq!(
        decode(&[&h, &big]),
        Err(DecodeError::Oversized(MAX_PAYLOAD + 1))
    );
}

/// A KV buffer in the `TKV1` layout: 32-byte header (layers at 8..12), then `layers`
/// equal slices.
fn fake_export(layers: u32, per_layer: usize) -> Vec<u8> {
    let mut p = b"TKV1".to_vec();
    p.extend_from_slice(&1u32.to_le_bytes());
    p.extend_from_slice(&layers.to_le_bytes());
    p.resize(32, 0);
    p.extend((0..layers as usize * per_layer).map(|i| (i * 7 % 251) as u8));
    p
}

#[test]
fn chunks_reassemble_exactly_and_validate_order_and_checksum() {
    let p = fake_export(30, chunks::MAX_CHUNK / 4 + 3);
    let cs = split(&p);
    assert!(
        cs.len() > 1 && cs.len() < 30,
        "several layers per chunk: {}",
        cs.len()
    );
    assert_eq!(cs.last().unwrap().end_layer, 30);
    let mut a = Assembler::default();
    for (i, c) in cs.iter().enumerate() {
        assert_eq!(a.push(c, p.len() as u64).unwrap(), i + 1 == cs.len());
    }
    assert_eq!(&a.into_payload()[..], &p[..]);

    // Out of order, corrupted, and oversized chunks are refused with the reason.
    let mut a = Assembler::default();
    assert!(matches!(
        a.push(&cs[1], u64::MAX),
        Err(ChunkError::OutOfOrder { got: 1, want: 0 })
    ));
    let mut bad = cs[0].clone();
    bad.data[10] ^= 1;
    assert!(matches!(
        a.push(&bad, u64::MAX),
        Err(ChunkError::Checksum { .. })
    ));
    assert!(matches!(a.push(&cs[0], 10), Err(ChunkError::TooLarge(_))));
    a.push(&cs[0], u64::MAX).unwrap();
    let mut skipped = cs[2].clone();
    skipped.index = 1;
    assert!(matches!(
        a.push(&skipped, u64::MAX),
        Err(ChunkError::BadOffset { .. })
    ));

    // Something that is no export still travels (the importer refuses it precisely).
    let odd = split(b"hello");
    assert_eq!(odd.len(), 1);
    assert_eq!(odd[0].data, b"hello");
}

#[test]
fn pooled_reassembly_reuses_buffers_within_the_bound() {
    let p = fake_export(30, 1000);
    let pool = BufferPool::default();
    let fill = |pool: &BufferPool| {
        let mut a = Assembler::with_pool(pool.clone());
        for c in split(&p) {
            a.push(&c, u64::MAX).unwrap();
        }
        a.into_payload()
    };
    let first = fill(&pool);
    assert_eq!(&first[..], &p[..]);
    let at = first.as_ptr();
    assert_eq!(pool.idle_bytes(), 0, "in use, not idle");
    drop(first);
    assert!(pool.idle_bytes() >= p.len(), "returned on drop");
    let second = fill(&pool);
    assert_eq!(second.as_ptr(), at, "the pooled buffer is reused");
    assert_eq!(&second[..], &p[..], "no stale bytes from the previous room");
    drop(second);

    // A room that fails half-way gives its buffer back too.
    let mut a = Assembler::with_pool(pool.clone());
    let before = pool.idle_bytes();
    a.push(&split(&p)[0], u64::MAX).unwrap();
    assert_eq!(pool.idle_bytes(), 0);
    drop(a);
    assert_eq!(pool.idle_bytes(), before);

    // Idle capacity never exceeds the bound: an oversized buffer is not kept, and a new
    // buffer evicts smaller ones rather than growing the pool past it.
    pool.give(Vec::with_capacity(POOL_BYTES + 1));
    assert_eq!(pool.idle_bytes(), before);
    pool.give(Vec::with_capacity(POOL_BYTES - 16));
    assert!(pool.idle_bytes() <= POOL_BYTES);
    assert!(pool.idle_bytes() >= POOL_BYTES - 16);
}

#[test]
fn chunk_fast_path_matches_the_general_codec_without_copies() {
    let p = fake_export(30, 1000);
    let planned = chunks::plan(&p);
    assert_eq!(planned.len(), split(&p).len());
    for c in planned {
        let fast = super::encode_chunk(3, 4, 5, &c);
        let general = encode(&Envelope {
            incarnation: 3,
            group_incarnation: 4,
            room: 5,
            msg: Message::KvChunk(c.to_owned()),
        });
        assert_eq!(fast, general, "same bytes on the wire");
        // Allocated at its final size: handing it to ZeroMQ (`into_boxed_slice`) does
        // not reallocate, i.e. does not copy the data again.
        assert_eq!(fast[1].capacity(), fast[1].len());
        let (h, d) = super::decode_borrowed(&[&fast[0], &fast[1]]).unwrap();
        assert_eq!((h.incarnation, h.group_incarnation, h.room), (3, 4, 5));
        let super::Decoded::Chunk(got) = d else {
            panic!("not a chunk: {d:?}")
        };
        assert_eq!(got, c);
        // The decoded data is the received frame's bytes, not a copy.
        assert_eq!(got.data.as_ptr(), fast[1][super::CHUNK_PREFIX..].as_ptr());
    }
}

fn prefill_env(sampling: SamplingParams) -> Envelope {
    Envelope {
        incarnation: 1,
        group_incarnation: 2,
        room: 3,
        msg: Message::Prefill(PrefillRequest {
            tokens: vec![5, 6, 7],
            sampling,
            cached_tokens: 0,
        }),
    }
}

proptest! {
    /// Sampling has one wire form: the parameters a decode sends are the ones the prefill
    /// samples its first token with, through the conversion and through a whole PREFILL.
    #[test]
    fn sampling_round_trips_through_its_wire_form(p in sampling()) {
        let w = WireSampling::from(&p);
        prop_assert_eq!(SamplingParams::try_from(w), Ok(p.clone()));
        let env = prefill_env(p);
        prop_assert_eq!(decode2(&encode(&env)), Ok(env));
    }

    /// Out of its limits, a parameter is refused by name (never clamped): the PREFILL
    /// does not decode, and the same check refuses it on the HTTP side.
    #[test]
    fn sampling_out_of_its_limits_does_not_decode(
        p in sampling(),
        field in 0usize..6,
        over in 1e-3f32..1e3,
    ) {
        let mut bad = p;
        let name = match field {
            0 => { bad.temperature = 2.0 + over; "temperature" }
            1 => { bad.top_p = -over; "top_p" }
            2 => { bad.frequency_penalty = -2.0 - over; "frequency_penalty" }
            3 => { bad.presence_penalty = 2.0 + over; "presence_penalty" }
            4 => { bad.repetition_penalty = -over; "repetition_penalty" }
            _ => { bad.logprobs = Some(21 + over as usize); "logprobs" }
        };
        prop_assert_eq!(bad.validate().map_err(|e| e.field), Err(name));
        let e = decode2(&encode(&prefill_env(bad))).unwrap_err();
        prop_assert!(
            matches!(&e, DecodeError::BadValue(m) if m.contains(name)),
            "{e:?}"
        );
    }
}

#[test]
fn counts_beyond_u32_narrow_to_u32_max_in_one_place() {
    let p = SamplingParams {
        top_k: usize::MAX,
        min_tokens: usize::MAX,
        ..Default::default()
    };
    let w = WireSampling::from(&p);
    assert_eq!((w.top_k, w.min_tokens), (u32::MAX, u32::MAX));
    // Past every vocabulary and context, so the same as before on the other side.
    let back = SamplingParams::try_from(w).unwrap();
    assert_eq!(back.top_k, u32::MAX as usize);
    for nan in [f32::NAN, f32::INFINITY] {
        let p = SamplingParams {
            temperature: nan,
            ..Default::default()
        };
        assert_eq!(p.validate().unwrap_err().field, "temperature");
    }
}
