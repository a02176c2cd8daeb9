//! Rotary position embedding tables.

use crate::error::{Result, shape};

/// Which dimensions rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])`: llama.cpp's "normal" rope, used for the `llama`
    /// architecture because the GGUF converter permutes Q/K rows to match it.
    Normal,
    /// Halves `(x[i], x[i + rot_dim/2])` (GPT-NeoX).
    Neox,
}

/// cos/sin of `pos · base^(-2i/rot_dim)` for every position below `max_pos`, computed in
/// f64 once so that no kernel evaluates transcendental functions per token. Scaled tables
/// ([`RopeTable::scaled`]) divide each pair's angle by a frequency factor and multiply all
/// angles by a frequency scale, which is all the forward pass needs for linear RoPE scaling
/// and Llama 3.1's `rope_freqs` factors: the kernels read the same two tables.
#[derive(Debug, Clone)]
pub struct RopeTable {
    style: RopeStyle,
    rot_dim: usize,
    max_pos: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(style: RopeStyle, rot_dim: usize, base: f32, max_pos: usize) -> Result<Self> {
        Self::scaled(style, rot_dim, base, 1.0, None, max_pos)
    }

    /// Angles `pos · freq_scale · base^(-2i/rot_dim) / factors[i]` (llama.cpp's
    /// `ggml_rope_ext` with frequency factors and no YaRN): `freq_scale` is
    /// `1 / rope.scaling.factor` under linear scaling, `factors` the `rope_freqs` tensor
    /// (one per rotated pair).
    pub fn scaled(
        style: RopeStyle,
        rot_dim: usize,
        base: f32,
        freq_scale: f32,
        factors: Option<&[f32]>,
        max_pos: usize,
    ) -> Result<Self> {
        if rot_dim == 0 || !rot_dim.is_multiple_of(2) {
            return Err(shape(
                "RopeTable",
                format!("rot_dim {rot_dim} must be even and > 0"),
            ));
        }
        let half = rot_dim / 2;
        if let Some(f) = factors
            && (f.len() != half || f.iter().any(|v| !(v.is_finite() && *v > 0.0)))
        {
            return Err(shape(
                "RopeTable",
                format!(
                    "{} frequency factors for {half} pairs (each must be finite and > 0)",
                    f.len()
                ),
            ));
        }
        if !(freq_scale.is_finite() && freq_scale > 0.0 && base.is_finite() && base > 0.0) {
            return Err(shape(
                "RopeTable",
                format!("base {base} and frequency scale {freq_scale} must be > 0"),
            ));
        }
        let freqs: Vec<f64> = (0..half)
            .map(|i| {
                let f = (base as f64).powf(-2.0 * i as f64 / rot_dim as f64) * freq_scale as f64;
                f / factors.map_or(1.0, |f| f[i] as f64)
            })
            .collect();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for freq in &freqs {
                let a = p as f64 * freq;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Ok(Self {
            style,
            rot_dim,
            max_pos,
            cos,
            sin,
        })
    }

    pub fn style(&self) -> RopeStyle {
        self.style
    }
    pub fn rot_dim(&self) -> usize {
        self.rot_dim
    }
    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// Rotate one head in place.
    #[inline]
    pub(crate) fn apply(&self, head: &mut [f32], pos: usize) {
        let half = self.rot_dim / 2;
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        for i in 0..half {
            let (a, b) = match self.style {
                RopeStyle::Normal => (2 * i, 2 * i + 1),
                RopeStyle::Neox => (i, i + half),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos[i] - x1 * sin[i];
            head[b] = x0 * sin[i] + x1 * cos[i];
        }
    }

    pub(crate) fn check(
        &self,
        x: &[f32],
        n_heads: usize,
        head_dim: usize,
        positions: &[usize],
    ) -> Result<()> {
        if self.rot_dim > head_dim || x.len() != positions.len() * n_heads * head_dim {
            return Err(shape(
                "rope",
                format!(
                    "{} values for {} tokens x {n_heads} heads x {head_dim} (rot {})",
                    x.len(),
                    positions.len(),
                    self.rot_dim
                ),
            ));
        }
        if let Some(p) = positions.iter().find(|p| **p >= self.max_pos) {
            return Err(shape(
                "rope",
                format!("position {p} beyond table of {}", self.max_pos),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_preserves_pair_norms_and_position_zero_is_identity() {
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            let t = RopeTable::new(style, 8, 10000.0, 16).unwrap();
            let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
            let mut y = x.clone();
            t.apply(&mut y, 0);
            assert_eq!(x, y);
            t.apply(&mut y, 5);
            assert_ne!(x, y);
            let n0: f32 = x.iter().map(|v| v * v).sum();
            let n1: f32 = y.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-4);
        }
        // Normal style rotates dims 0 and 1 together with the fastest frequency (1 rad/pos).
        let t = RopeTable::new(RopeStyle::Normal, 4, 10000.0, 4).unwrap();
        let mut h = [1.0, 0.0, 0.0, 0.0];
        t.apply(&mut h, 1);
        assert!((h[0] - 1f32.cos()).abs() < 1e-6 && (h[1] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn scaled_tables_divide_angles_by_factors_and_multiply_by_the_scale() {
        let plain = RopeTable::new(RopeStyle::Neox, 8, 1e4, 64).unwrap();
        let factors = [1.0, 2.0, 4.0, 8.0];
        let t = RopeTable::scaled(RopeStyle::Neox, 8, 1e4, 0.5, Some(&factors), 64).unwrap();
        for p in [1usize, 7, 63] {
            for (i, f) in factors.iter().enumerate() {
                // The angle of pair i at p equals the plain table's at p / (f / 0.5) when
                // that is a whole position: check through cos/sin of the f64 angle.
                let want = p as f64 * 0.5 * 1e4f64.powf(-2.0 * i as f64 / 8.0) / *f as f64;
                assert!((t.cos[p * 4 + i] as f64 - want.cos()).abs() < 1e-6);
                assert!((t.sin[p * 4 + i] as f64 - want.sin()).abs() < 1e-6);
            }
        }
        // Factor 1 and scale 1 are the plain table, bit for bit.
        let same = RopeTable::scaled(RopeStyle::Neox, 8, 1e4, 1.0, Some(&[1.0; 4]), 64).unwrap();
        assert_eq!((same.cos, same.sin), (plain.cos.clone(), plain.sin.clone()));
        for bad in [
            &[1.0, 2.0][..],
            &[1.0, 0.0, 1.0, 1.0],
            &[1.0, f32::NAN, 1.0, 1.0],
        ] {
            assert!(RopeTable::scaled(RopeStyle::Neox, 8, 1e4, 1.0, Some(bad), 4).is_err());
        }
        assert!(RopeTable::scaled(RopeStyle::Neox, 8, 1e4, 0.0, None, 4).is_err());
    }

    #[test]
    fn rejects_odd_dims_and_far_positions() {
        assert!(RopeTable::new(RopeStyle::Normal, 7, 1e4, 4).is_err());
        let t = RopeTable::new(RopeStyle::Normal, 4, 1e4, 4).unwrap();
        assert!(t.check(&[0.0; 4], 1, 4, &[4]).is_err());
        assert!(t.check(&[0.0; 4], 1, 4, &[3]).is_ok());
    }
}
