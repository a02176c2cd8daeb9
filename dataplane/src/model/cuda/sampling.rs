//! Sampling on the device (`step_sample`, [`super::CudaOptions::device_sampling`]):
//! greedy, temperature, top-k and top-p run in `tandem_sample` (sampling.cu) with the host
//! sampler's semantics; per row only the parameters and one uniform number go in, drawn
//! on the host from the request's seeded RNG ([`Sampler::draw`]), so a seed gives the same
//! tokens as host sampling of the same logits, up to float rounding of the
//! probabilities. The kernel materialises the 256 best candidates; a row whose decision
//! needs a candidate past them (the top-p prefix or, with top_p = 1, the draw lands in the
//! tail) is finished on the host from that row's logits with the same draw, so there is no
//! candidate cap in the results. Rows of requests asking for logprobs copy their logits to
//! the host and use `Sampler::sample` (the logprobs need the whole row), and so do rows
//! whose sampler adjusts its logits first ([`Sampler::adjusts_logits`]: repetition,
//! frequency or presence penalties, or `min_tokens` masking): those need the sequence's
//! token history, which lives in the host sampler, and the kernel takes none; they are
//! rare enough that a row copy per token is the simpler price. Counted in
//! [`SamplingStats`].

use tandem_kernels::cuda::launch::{self, SampleRow};
use tandem_kernels::cuda::{CudaDevice, CudaSlice};

use super::CudaModelRunner;
use crate::engine_api::{Sampled, StepInput};
use crate::error::{Error, Result};
use crate::sampling::{Sampler, SamplingParams};

/// Where `step_sample` sampled its rows since load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SamplingStats {
    /// Decided by the device: only the token id was copied back.
    pub device_rows: u64,
    /// Left to the host by the device (beyond its candidates, or no finite logit); the
    /// row's logits were copied back and sampled with the same draw.
    pub deferred_rows: u64,
    /// Sampled on the host from the start (logprobs requested, penalties or `min_tokens`
    /// masking, parameters the kernel does not take, or device sampling switched off).
    pub host_rows: u64,
}

/// How `tandem_sample` takes a request's rows; `None`: on the host. Requests asking for
/// logprobs need the whole row of logits; and a 1/T that is not finite and positive or a
/// NaN top_p would not mean on the device what it means to the host sampler. The uniform
/// number is filled in per row.
pub(super) fn device_row(p: &SamplingParams) -> Option<SampleRow> {
    if p.logprobs.is_some() {
        return None;
    }
    if p.temperature <= 0.0 {
        return Some(SampleRow::GREEDY);
    }
    // Exactly the host sampler's scale factor, so the scaled logits are the same bits.
    let inv = 1.0 / p.temperature;
    if !(inv.is_finite() && inv > 0.0) || p.top_p.is_nan() {
        return None;
    }
    Some(SampleRow {
        inv_temperature: inv,
        top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
        top_p: p.top_p,
        uniform: 0.0,
    })
}

/// [`device_row`] of a sampler's next row. Penalties and `min_tokens` masking adjust the
/// logits from the sequence's token history, which only the host sampler holds and the
/// kernel does not take: while they apply, the row goes to the host.
pub(super) fn sampler_row(s: &Sampler) -> Option<SampleRow> {
    if s.adjusts_logits() {
        return None;
    }
    device_row(s.params())
}

/// Device buffers of the sampling kernels for up to `cap` rows: per row the packed
/// parameters in, the token id out. Sampling runs after the forward pass, outside any
/// graph, so these may grow freely.
pub(super) struct SampleBufs {
    cap: usize,
    params: CudaSlice<u32>,
    ids: CudaSlice<u32>,
}

impl SampleBufs {
    pub(super) fn new(dev: &CudaDevice, cap: usize) -> Result<Self> {
        Ok(Self {
            cap,
            params: dev.zeros(cap * launch::SAMPLE_WORDS)?,
            ids: dev.zeros(cap)?,
        })
    }

    fn ensure(&mut self, dev: &CudaDevice, rows: usize) -> Result<()> {
        if rows > self.cap {
            *self = Self::new(dev, rows.next_power_of_two())?;
        }
        Ok(())
    }
}

impl CudaModelRunner {
    /// Row `r` of the last step's logits, copied to the host.
    pub(super) fn logits_row(&self, r: usize) -> Result<Vec<f32>> {
        let vocab = self.model.config().vocab_size;
        let logits = self.model.activations().logits();
        Ok(self
            .dev()
            .download(&logits.slice(r * vocab..(r + 1) * vocab), vocab)?)
    }

    /// Greedy token ids of the first `rows` logits rows of the last step, chosen on the
    /// device.
    pub(super) fn argmax_rows(&mut self, rows: usize) -> Result<Vec<u32>> {
        let vocab = self.model.config().vocab_size;
        let dev = self.model.backend().device();
        self.samples.ensure(dev, rows)?;
        dev.argmax(
            &self.model.activations().logits().as_view(),
            rows,
            vocab,
            &mut self.samples.ids.as_view_mut(),
        )?;
        Ok(dev.download(&self.samples.ids.as_view(), rows)?)
    }

    /// Sample the `rows` logits rows of the last forward step (the `want_logits` entries
    /// of `batch`, in order) for `step_sample`.
    pub(super) fn sample_rows(
        &mut self,
        batch: &[StepInput],
        samplers: &mut [&mut Sampler],
        rows: usize,
    ) -> Result<Vec<Option<Sampled>>> {
        let vocab = self.model.config().vocab_size;
        let owners: Vec<usize> = (0..batch.len()).filter(|&j| batch[j].want_logits).collect();
        // The forward pass leaves one row per `want_logits` entry.
        debug_assert_eq!(owners.len(), rows);
        let rows = owners.len();
        // Per row: `Some(draw)` when the device samples it (the draw is made now, in the
        // place `Sampler::sample` would make it), `None` when the host does.
        let mut draws: Vec<Option<Option<f32>>> = Vec::with_capacity(rows);
        let mut packed = Vec::with_capacity(rows);
        for &j in &owners {
            let s = &mut *samplers[j];
            match sampler_row(s) {
                Some(mut row) => {
                    let u = s.draw();
                    row.uniform = u.unwrap_or(0.0);
                    packed.push(row);
                    draws.push(Some(u));
                }
                None => {
                    packed.push(SampleRow::GREEDY);
                    draws.push(None);
                }
            }
        }
        let mut ids = vec![launch::SAMPLE_DEFER; rows];
        if draws.iter().any(Option::is_some) {
            let dev = self.model.backend().device();
            self.samples.ensure(dev, rows)?;
            let b = &mut self.samples;
            dev.upload_into(&launch::pack_sample_rows(&packed), &mut b.params)?;
            dev.sample(
                &self.model.activations().logits().as_view(),
                rows,
                vocab,
                &b.params.as_view(),
                &mut b.ids.as_view_mut(),
            )?;
            ids = dev.download(&b.ids.as_view(), rows)?;
        }
        let mut out: Vec<Option<Sampled>> = vec![None; batch.len()];
        for (r, &j) in owners.iter().enumerate() {
            let s = &mut *samplers[j];
            out[j] = Some(match draws[r] {
                Some(_) if ids[r] != launch::SAMPLE_DEFER => {
                    if ids[r] as usize >= vocab {
                        return Err(Error::Kernel(tandem_kernels::Error::Cuda(format!(
                            "the device sampler returned token {} (vocabulary of {vocab})",
                            ids[r]
                        ))));
                    }
                    self.sampling.device_rows += 1;
                    // Device rows never ask for logprobs (see `device_row`).
                    (ids[r], None)
                }
                Some(u) => {
                    self.sampling.deferred_rows += 1;
                    tracing::debug!(row = r, "device sampler deferred a row to the host");
                    s.sample_drawn(&self.logits_row(r)?, u)
                }
                None => {
                    self.sampling.host_rows += 1;
                    s.sample(&self.logits_row(r)?)
                }
            });
        }
        Ok(out)
    }
}
