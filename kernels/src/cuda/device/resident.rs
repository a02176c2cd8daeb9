//! Device-resident model state: weight matrices in their GGUF layout, rope tables and
//! the paged KV pools, uploaded or allocated once.

use cudarc::driver::CudaSlice;

use super::CudaDevice;
use crate::api::Matrix;
use crate::error::{Result, shape};
use crate::rope::{RopeStyle, RopeTable};
use crate::types::GgmlType;

/// A weight matrix uploaded once, in its GGUF layout.
#[derive(Debug)]
pub struct DeviceMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: CudaSlice<u8>,
}

impl DeviceMatrix {
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }
}

/// A rope table on the device: `[max_pos][rot_dim / 2]` cos and sin.
#[derive(Debug)]
pub struct DeviceRope {
    pub style: RopeStyle,
    pub rot_dim: usize,
    pub max_pos: usize,
    pub cos: CudaSlice<f32>,
    pub sin: CudaSlice<f32>,
}

/// Paged K and V pools of every layer: `k` is `[layer][pool]`, likewise `v`; a pool is
/// `n_blocks · block_tokens` rows of `row_bytes` (the layout of the CPU backend's
/// `HostKv`).
#[derive(Debug)]
pub struct DeviceKv {
    pub ty: GgmlType,
    pub n_layers: usize,
    pub kv_dim: usize,
    pub block_tokens: usize,
    pub n_blocks: usize,
    pub row_bytes: usize,
    pub k: CudaSlice<u8>,
    pub v: CudaSlice<u8>,
}

impl DeviceKv {
    pub fn pool_bytes(&self) -> usize {
        self.n_blocks * self.block_tokens * self.row_bytes
    }

    /// Bytes of all K and V pools (what [`CudaDevice::alloc_kv`] allocates).
    pub fn bytes_for(
        ty: GgmlType,
        n_layers: usize,
        kv_dim: usize,
        block_tokens: usize,
        n_blocks: usize,
    ) -> Result<usize> {
        let row = ty.row_bytes(kv_dim)?;
        [n_blocks, block_tokens, row, n_layers, 2]
            .into_iter()
            .try_fold(1usize, |a, b| a.checked_mul(b))
            .ok_or_else(|| shape("cuda kv", "KV pool size overflows"))
    }
}

impl CudaDevice {
    /// The device kernels read GGUF rows: a matrix in another layout is gathered back
    /// into them first.
    pub fn upload_matrix(&self, m: &Matrix<'_>) -> Result<DeviceMatrix> {
        Matrix::with_layout(m.ty, m.rows, m.cols, m.data, m.layout)?;
        Ok(DeviceMatrix {
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            data: self.upload(&m.to_gguf())?,
        })
    }

    /// The table's cos/sin values read back through its public rotation (a unit vector
    /// in each pair rotates to exactly (cos, sin)), so the device uses the very same f32
    /// values as the CPU backends.
    pub fn upload_rope(&self, t: &RopeTable) -> Result<DeviceRope> {
        let (rot, half) = (t.rot_dim(), t.rot_dim() / 2);
        let mut unit = vec![0f32; rot];
        for i in 0..half {
            let a = match t.style() {
                RopeStyle::Normal => 2 * i,
                RopeStyle::Neox => i,
            };
            unit[a] = 1.0;
        }
        let n = t.max_pos();
        let mut x: Vec<f32> = Vec::with_capacity(n * rot);
        for _ in 0..n {
            x.extend_from_slice(&unit);
        }
        let positions: Vec<usize> = (0..n).collect();
        crate::Kernels::rope(&crate::ScalarKernels, &mut x, 1, rot, &positions, t)?;
        let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
        for head in x.chunks_exact(rot) {
            for i in 0..half {
                let (a, b) = match t.style() {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                cos.push(head[a]);
                sin.push(head[b]);
            }
        }
        Ok(DeviceRope {
            style: t.style(),
            rot_dim: rot,
            max_pos: n,
            cos: self.upload(&cos)?,
            sin: self.upload(&sin)?,
        })
    }

    pub fn alloc_kv(
        &self,
        ty: GgmlType,
        n_layers: usize,
        kv_dim: usize,
        block_tokens: usize,
        n_blocks: usize,
    ) -> Result<DeviceKv> {
        if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0) {
            return Err(shape(
                "cuda kv",
                format!("KV dtype {ty} (use F32, F16 or Q8_0)"),
            ));
        }
        if block_tokens == 0 || n_blocks == 0 || n_blocks > u32::MAX as usize {
            return Err(shape(
                "cuda kv",
                format!("{n_blocks} blocks of {block_tokens}"),
            ));
        }
        // The store kernel encodes whole 32-value chunks (Q8_0 blocks).
        if kv_dim == 0 || !kv_dim.is_multiple_of(crate::QK) {
            return Err(shape(
                "cuda kv",
                format!("kv_dim {kv_dim} is not a multiple of 32"),
            ));
        }
        let total = DeviceKv::bytes_for(ty, n_layers, kv_dim, block_tokens, n_blocks)?;
        Ok(DeviceKv {
            ty,
            n_layers,
            kv_dim,
            block_tokens,
            n_blocks,
            row_bytes: ty.row_bytes(kv_dim)?,
            k: self.zeros(total / 2)?,
            v: self.zeros(total / 2)?,
        })
    }
}
