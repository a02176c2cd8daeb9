//! The CUDA runner's step: the one forward pass, by graph replay for decode steps when
//! graphs are on ([`super::graphs`]), else launch by launch through [`LoadedModel::step`]
//! (`crate::model::LoadedModel`), whose step inputs are uploaded once per step.

use super::CudaModelRunner;
use super::graphs::decode_bucket;
use crate::engine_api::StepInput;
use crate::error::Result;

impl CudaModelRunner {
    /// Run the batch through the model; leaves the logits of the `want_logits` entries in
    /// the activations (rows in batch order) and returns how many there are.
    pub(super) fn forward(&mut self, batch: &[StepInput]) -> Result<usize> {
        if self.opts.graphs
            && let Some(bucket) = decode_bucket(batch)
            && !self.graphs.gave_up_on(bucket)
            && let Some(rows) = self.graphs.run(&mut self.model, batch, bucket)?
        {
            return Ok(rows);
        }
        let out = self.model.step(batch)?;
        if out.buffers_moved {
            self.graphs.buffers_moved(self.model.activations().caps());
        }
        Ok(out.rows)
    }

    /// Like [`crate::engine_api::ModelRunner::step`], but sampling greedily on the device:
    /// only the token ids of the `want_logits` entries come back.
    pub fn step_greedy(&mut self, batch: &[StepInput]) -> Result<Vec<Option<u32>>> {
        let rows = self.forward(batch)?;
        let mut ids = self.argmax_rows(rows)?.into_iter();
        Ok(batch
            .iter()
            .map(|b| if b.want_logits { ids.next() } else { None })
            .collect())
    }
}
