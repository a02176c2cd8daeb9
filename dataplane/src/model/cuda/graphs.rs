//! CUDA graphs for decode steps. A step whose entries are all one token with logits, at
//! most [`GRAPH_MAX_BATCH`] of them, runs as a graph captured for its batch-size bucket
//! over fixed input buffers (`DecodeInputs`: tokens, positions, KV slots, context lengths,
//! block tables), refreshed by copies before each replay; the batch is padded to the
//! bucket with rows that write no KV and whose outputs are dropped. What is captured is
//! the one forward pass (`model::forward`) over those inputs. Graphs hold the activation
//! buffers by address, so reallocating those drops the graphs (captured again on use).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

use tandem_kernels::cuda::launch::DecodeRow;
use tandem_kernels::cuda::{CudaBackend, DecodeInputs, DeviceGraph};

use crate::engine_api::StepInput;
use crate::error::Result;
use crate::model::forward::forward;
use crate::model::loaded::LoadedModel;

/// Batch sizes decode graphs are captured for. A decode step of `n` sequences replays
/// the graph of the smallest bucket `>= n`. 16 is a bucket so that a batch of up to
/// `launch::MMV_MAX_TOKENS` rows is never padded past it: the padded graph runs the same
/// matrix kernels as the batch would without a graph.
pub const GRAPH_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 24, 32, 48, 64];

/// The largest decode batch that runs as a graph.
pub const GRAPH_MAX_BATCH: usize = GRAPH_BUCKETS[GRAPH_BUCKETS.len() - 1];

/// The graph bucket of a decode step of `n` sequences; `None` for 0 or above the largest.
pub fn graph_bucket(n: usize) -> Option<usize> {
    GRAPH_BUCKETS.iter().copied().find(|&b| n > 0 && b >= n)
}

/// Whether a step is a pure decode step (every entry one token, with logits) that a graph
/// can replay, and its bucket.
pub(super) fn decode_bucket(batch: &[StepInput]) -> Option<usize> {
    if batch.iter().all(|b| b.tokens.len() == 1 && b.want_logits) {
        graph_bucket(batch.len())
    } else {
        None
    }
}

/// Block-table entries of a graph step's inputs: each of `rows` sequences may use a whole
/// context's blocks, plus the padding rows' one entry.
pub(super) fn decode_table_cap(rows: usize, context_length: usize, block_tokens: usize) -> usize {
    rows * context_length.div_ceil(block_tokens.max(1)) + 1
}

/// How decode graphs fared since load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GraphStats {
    /// Graphs captured (one per bucket, again after an invalidation).
    pub captured: u64,
    /// Steps run by replaying a graph.
    pub replayed: u64,
    /// Captures that failed (each logged; that bucket then runs without a graph).
    pub capture_failures: u64,
    /// Times all graphs were dropped because the activation buffers moved.
    pub invalidated: u64,
}

/// Decode graphs by bucket, over one set of fixed inputs.
#[derive(Default)]
pub(super) struct DecodeGraphs {
    inputs: Option<DecodeInputs>,
    graphs: HashMap<usize, DeviceGraph>,
    /// Buckets whose capture failed: not tried again (until the options change).
    failed: HashSet<usize>,
    pub(super) stats: GraphStats,
}

impl DecodeGraphs {
    /// Forget every graph and failed capture (graphs switched off or on).
    pub(super) fn reset(&mut self) {
        self.graphs.clear();
        self.failed.clear();
    }

    /// The activation buffers moved: drop the graphs that refer to them.
    pub(super) fn buffers_moved(&mut self, caps: (usize, usize)) {
        if !self.graphs.is_empty() {
            tracing::info!(
                graphs = self.graphs.len(),
                cap = caps.0,
                want_cap = caps.1,
                "CUDA decode graphs dropped: the activation buffers grew (captured again on use)"
            );
            self.graphs.clear();
            self.stats.invalidated += 1;
        }
    }

    pub(super) fn gave_up_on(&self, bucket: usize) -> bool {
        self.failed.contains(&bucket)
    }

    /// A decode step by graph replay; leaves its logits in the activations like a plain
    /// step and returns their rows. `Ok(None)`: this bucket's capture failed (logged and
    /// counted); the caller runs the step without a graph.
    pub(super) fn run(
        &mut self,
        m: &mut LoadedModel<CudaBackend>,
        batch: &[StepInput],
        bucket: usize,
    ) -> Result<Option<usize>> {
        m.admit(batch)?;
        // Sized once for every bucket, so that later captures do not move them.
        if m.ensure_activations(GRAPH_MAX_BATCH, GRAPH_MAX_BATCH)? {
            self.buffers_moved(m.activations().caps());
        }
        let dev = m.backend.device();
        if self.inputs.is_none() {
            let table_cap = decode_table_cap(
                GRAPH_MAX_BATCH,
                m.config().context_length,
                m.blocks.block_tokens(),
            );
            self.inputs = Some(dev.alloc_decode_inputs(GRAPH_MAX_BATCH, table_cap)?);
        }
        let rows: Vec<DecodeRow<'_>> = batch
            .iter()
            .map(|b| DecodeRow {
                token: b.tokens[0],
                position: m.blocks.len(b.seq),
                table: m.blocks.table(b.seq),
            })
            .collect();
        let inputs = self.inputs.as_mut().expect("allocated above");
        dev.write_decode_inputs(inputs, &m.kv, &rows, bucket)?;
        let g = match self.graphs.entry(bucket) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(slot) => {
                let step = inputs.step();
                let (be, w, kv, acts) = (&m.backend, &m.weights, &mut m.kv, &mut m.acts);
                match dev.capture(|| forward(be, w, kv, acts, step, bucket, bucket)) {
                    Ok(g) => {
                        tracing::info!(bucket, "captured a CUDA graph for decode steps");
                        self.stats.captured += 1;
                        slot.insert(g)
                    }
                    Err(e) => {
                        tracing::warn!(
                            bucket,
                            error = %e,
                            "CUDA graph capture failed: decode steps of this size run without a graph"
                        );
                        self.failed.insert(bucket);
                        self.stats.capture_failures += 1;
                        return Ok(None);
                    }
                }
            }
        };
        dev.launch_graph(g)?;
        self.stats.replayed += 1;
        m.finish(batch);
        // Inputs live in fixed buffers: nothing to wait for before returning.
        Ok(Some(batch.len()))
    }
}
