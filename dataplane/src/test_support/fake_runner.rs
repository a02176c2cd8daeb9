//! A deterministic toy `ModelRunner` for scheduler and server tests: its next token
//! depends on the whole token history of a sequence, so any mix-up between batched
//! sequences changes outputs. It tests scheduling, not the model.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::engine_api::{KvUsage, ModelInfo, ModelRunner, SeqId, StepInput};
use crate::tokenizer::TokenText;
use crate::{Error, Result};

pub const VOCAB: usize = 40;
pub const BLOCK: usize = 4;

#[derive(Default)]
pub struct FakeState {
    pub seqs: HashMap<SeqId, (usize, Vec<u32>)>, // reserved blocks, tokens
    pub blocks_total: usize,
    /// Per step: (seq, number of tokens, want_logits).
    pub log: Vec<Vec<(SeqId, usize, bool)>>,
    pub step_delay: Duration,
    pub panic_on_token: Option<u32>,
    /// What `prefix_keys` reports (the toy has no prefix cache of its own).
    pub prefix: Option<crate::engine_api::PrefixKeys>,
}

impl FakeState {
    pub fn used(&self) -> usize {
        self.seqs.values().map(|s| s.0).sum()
    }
}

pub struct FakeRunner {
    info: ModelInfo,
    st: Arc<Mutex<FakeState>>,
}

pub fn fake(blocks_total: usize) -> (FakeRunner, Arc<Mutex<FakeState>>) {
    let st = Arc::new(Mutex::new(FakeState {
        blocks_total,
        ..Default::default()
    }));
    let info = ModelInfo {
        name: "toy".into(),
        vocab_size: VOCAB,
        context_length: 1024,
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 1,
        kv_block_size: BLOCK,
        fingerprint: "0".into(),
    };
    (
        FakeRunner {
            info,
            st: st.clone(),
        },
        st,
    )
}

/// The toy model: a hash of the full history picks a favourite token (never 0 or 1).
fn toy_logits(hist: &[u32]) -> Vec<f32> {
    let h = hist
        .iter()
        .fold(17u64, |h, &t| h.wrapping_mul(31).wrapping_add(t as u64 + 1));
    let fav = (h % (VOCAB as u64 - 2)) as usize + 2;
    (0..VOCAB)
        .map(|j| {
            if j == fav {
                4.0
            } else {
                ((h ^ (j as u64 * 2_654_435_761)) % 100) as f32 / 100.0
            }
        })
        .collect()
}

impl FakeRunner {
    /// The toy panics on purpose while holding the lock; later calls must still work.
    fn lock(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ModelRunner for FakeRunner {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<()> {
        let mut st = self.lock();
        let need = total_tokens.div_ceil(BLOCK);
        let have = st.seqs.get(&seq).map_or(0, |s| s.0);
        let free = st.blocks_total - st.used();
        if need > have && need - have > free {
            return Err(Error::KvCacheFull {
                needed: need - have,
                free,
            });
        }
        st.seqs.entry(seq).or_default().0 = need.max(have);
        Ok(())
    }
    fn step(&mut self, batch: &[StepInput]) -> Result<Vec<Option<Vec<f32>>>> {
        let mut st = self.lock();
        std::thread::sleep(st.step_delay);
        st.log.push(
            batch
                .iter()
                .map(|b| (b.seq, b.tokens.len(), b.want_logits))
                .collect(),
        );
        let mut out = Vec::new();
        for b in batch {
            if st.panic_on_token.is_some_and(|p| b.tokens.contains(&p)) {
                panic!("toy runner told to panic");
            }
            let s = st
                .seqs
                .get_mut(&b.seq)
                .ok_or_else(|| Error::InvalidInput(format!("unknown {:?}", b.seq)))?;
            s.1.extend_from_slice(&b.tokens);
            assert!(s.1.len() <= s.0 * BLOCK, "wrote past the reservation");
            out.push(b.want_logits.then(|| toy_logits(&s.1)));
        }
        Ok(out)
    }
    fn seq_len(&self, seq: SeqId) -> usize {
        self.lock().seqs.get(&seq).map_or(0, |s| s.1.len())
    }
    fn free(&mut self, seq: SeqId) {
        self.lock().seqs.remove(&seq);
    }
    fn prefix_keys(&self, since: u64) -> Option<crate::engine_api::PrefixKeys> {
        self.lock().prefix.clone().filter(|p| p.version != since)
    }

    fn kv_usage(&self) -> KvUsage {
        let st = self.lock();
        KvUsage {
            blocks_total: st.blocks_total,
            blocks_used: st.used(),
            ..Default::default()
        }
    }
    /// The toy's "KV" is its token history, as little-endian u32s.
    fn export_kv(&self, seq: SeqId) -> Result<Vec<u8>> {
        let st = self.lock();
        let s = st
            .seqs
            .get(&seq)
            .ok_or_else(|| Error::InvalidInput(format!("export of unknown {seq:?}")))?;
        Ok(s.1.iter().flat_map(|t| t.to_le_bytes()).collect())
    }
    fn import_kv(&mut self, seq: SeqId, payload: &[u8]) -> Result<()> {
        if !payload.len().is_multiple_of(4) {
            return Err(Error::KvTransfer("toy KV is whole u32s".into()));
        }
        let hist: Vec<u32> = payload
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        self.reserve(seq, hist.len())?;
        let mut st = self.lock();
        let s = st.seqs.entry(seq).or_default();
        if !s.1.is_empty() {
            return Err(Error::KvTransfer(format!("{seq:?} already holds tokens")));
        }
        s.1 = hist;
        Ok(())
    }
}

/// Token id -> one letter.
pub struct Letters(Vec<Vec<u8>>);
impl TokenText for Letters {
    fn token_bytes(&self, id: u32) -> &[u8] {
        &self.0[id as usize]
    }
}
pub fn letters() -> Arc<dyn TokenText> {
    letters_for(VOCAB)
}
/// One letter per token of a `vocab`-token vocabulary.
pub fn letters_for(vocab: usize) -> Arc<dyn TokenText> {
    Arc::new(Letters(
        (0..vocab).map(|i| vec![b'a' + (i % 26) as u8]).collect(),
    ))
}
