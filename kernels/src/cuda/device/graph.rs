//! CUDA graphs of decode steps: fixed-address step inputs, capture and replay.

use cudarc::driver::{CudaGraph, sys};

use super::{CudaDevice, CudaStep, DeviceAttnPlan, DeviceKv, driver_err, i32_of};
use crate::cuda::launch::{self, DecodeRow};
use crate::error::{Error, Result, shape};

/// Fixed device buffers of a decode step (one new token for each of up to `cap`
/// sequences), so that a CUDA graph captured over them stays valid from step to step:
/// [`CudaDevice::write_decode_inputs`] refreshes their contents by copies before each
/// launch, and every per-step value the kernels need (tokens, positions, KV slots,
/// context lengths, block tables) is read from them on the device.
#[derive(Debug)]
pub struct DecodeInputs {
    cap: usize,
    table_cap: usize,
    /// `want` is `0..cap`: every row wants logits, in order.
    step: CudaStep,
}

impl DecodeInputs {
    /// Most rows (the largest bucket).
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Most block-table entries over all rows of a step.
    pub fn table_cap(&self) -> usize {
        self.table_cap
    }

    /// Rows of the last write (the bucket), as the attention plan sees them.
    pub fn rows(&self) -> usize {
        self.step.plan.n_queries
    }

    /// The last write as step inputs: decode attention, all single-token queries.
    pub fn step(&self) -> &CudaStep {
        &self.step
    }
}

/// Work recorded by [`CudaDevice::capture`], replayed by [`CudaDevice::launch_graph`]. It
/// refers to the device buffers it was recorded with by address: they must outlive it and
/// must not be reallocated while it is in use.
pub struct DeviceGraph {
    graph: CudaGraph,
}

impl std::fmt::Debug for DeviceGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceGraph")
    }
}

// SAFETY: a CUDA graph and its executable are plain driver handles that any thread may
// use as long as calls on them are serialized (CUDA's graph thread-safety rules); this
// type is not `Sync` and every use goes through `&self` of its one owner, so moving it to
// another thread (the engine thread owns the runner) cannot introduce concurrent access.
unsafe impl Send for DeviceGraph {}

impl CudaDevice {
    /// Buffers for decode steps of up to `cap` rows and `table_cap` block-table entries.
    pub fn alloc_decode_inputs(&self, cap: usize, table_cap: usize) -> Result<DecodeInputs> {
        if cap == 0 || table_cap <= cap {
            return Err(shape(
                "decode inputs",
                format!("{cap} rows, {table_cap} table entries"),
            ));
        }
        let rows: Vec<i32> = (0..i32_of(cap)?).collect();
        let want: Vec<u32> = (0..cap as u32).collect();
        Ok(DecodeInputs {
            cap,
            table_cap,
            step: CudaStep {
                tokens: self.zeros(cap)?,
                positions: self.zeros(cap)?,
                slots: self.upload(&vec![-1i64; cap])?,
                want: self.upload(&want)?,
                plan: DeviceAttnPlan {
                    n_queries: cap,
                    n_singles: cap,
                    n_tiles: 0,
                    singles: self.upload(&rows)?,
                    tiles: self.zeros(1)?,
                    n_ctx: self.upload(&vec![1i32; cap])?,
                    tbl_off: self.zeros(cap)?,
                    tables: self.zeros(table_cap)?,
                },
            },
        })
    }

    /// Copy one decode step into `inp`, padded to `bucket` rows ([`launch::pack_decode`]
    /// checks every block id against `kv`). The copies are ordered on the stream before
    /// whatever is launched next.
    pub fn write_decode_inputs(
        &self,
        inp: &mut DecodeInputs,
        kv: &DeviceKv,
        rows: &[DecodeRow<'_>],
        bucket: usize,
    ) -> Result<()> {
        if bucket > inp.cap {
            return Err(shape(
                "decode inputs",
                format!("bucket {bucket} over {}", inp.cap),
            ));
        }
        let p = launch::pack_decode(rows, bucket, kv.block_tokens, kv.n_blocks, inp.table_cap)?;
        let st = &mut inp.step;
        self.upload_into(&p.tokens, &mut st.tokens)?;
        self.upload_into(&p.positions, &mut st.positions)?;
        self.upload_into(&p.slots, &mut st.slots)?;
        self.upload_into(&p.n_ctx, &mut st.plan.n_ctx)?;
        self.upload_into(&p.tbl_off, &mut st.plan.tbl_off)?;
        self.upload_into(&p.tables, &mut st.plan.tables)?;
        st.plan.n_queries = bucket;
        st.plan.n_singles = bucket;
        Ok(())
    }

    /// Record the work `record` enqueues on the stream into a graph instead of running
    /// it. Nothing executes while recording, and `record` must only launch kernels (no
    /// allocation, copy or synchronization: the driver refuses those during a capture).
    /// The capture is always ended, also when `record` fails, so the stream is usable
    /// afterwards either way.
    /// `record`'s error type is the caller's (anything a kernel [`Error`] converts into).
    pub fn capture<E: From<Error>>(
        &self,
        record: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<DeviceGraph, E> {
        // Thread-local mode: only this thread's capture-unsafe calls are refused, other
        // threads' contexts (tests, other runners) are unaffected.
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver_err("beginning a graph capture"))?;
        let recorded = record();
        let ended = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver_err("ending a graph capture"));
        recorded?;
        let graph = ended?.ok_or_else(|| Error::Cuda("graph capture recorded nothing".into()))?;
        graph
            .upload()
            .map_err(driver_err("uploading a captured graph"))?;
        Ok(DeviceGraph { graph })
    }

    /// Replay a captured graph on the stream (asynchronously, like a kernel launch).
    pub fn launch_graph(&self, g: &DeviceGraph) -> Result<()> {
        g.graph.launch().map_err(driver_err("graph launch"))
    }
}
