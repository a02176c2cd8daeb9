//! What the CUDA CPU executor costs (feature `cuda-sim`): SmolLM2-135M's per-token matrix
//! shapes through the real `.cu` kernels on the CPU, with the executor's counters.
//!
//! cargo run --release -p tandem-kernels --features cuda-sim --example cuda_sim_speed
//!
//! (NVRTC on LD_LIBRARY_PATH, as for every CUDA run.) Figures per product: the executor's
//! CPU time inside the launches (the mean over `REPS`, default 3, runs: unlike wall time it
//! does not depend on what else the machine runs), and fiber switches per output row and
//! per switch; speed of the executor, never of a GPU.

use tandem_kernels::cuda::{CudaKernels, sim};
use tandem_kernels::{GgmlType, Kernels, Matrix, quantize_row};

fn main() {
    let exec = sim::install().unwrap_or_else(|e| panic!("{e}"));
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    let k = CudaKernels::new(0).unwrap_or_else(|e| panic!("{e}"));
    let mut seed = 1u64;
    let mut rnd = move |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    };
    // Rows x cols of one layer's products, and the output head.
    let shapes = [
        (576, 576, "q/o"),
        (1536, 576, "gate/up"),
        (576, 1536, "down"),
        (49152, 576, "head"),
    ];
    println!(
        "{:>8} {:>6} {:>6} {:>10} {:>14} {:>12}",
        "matrix", "tokens", "type", "CPU ms", "switches/row", "ns/switch"
    );
    for (rows, cols, name) in shapes {
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            let rb = ty.row_bytes(cols).unwrap();
            let mut w = vec![0u8; rows * rb];
            for (r, dst) in w.chunks_mut(rb).enumerate() {
                quantize_row(ty, &rnd(cols), dst).unwrap_or_else(|e| panic!("row {r}: {e}"));
            }
            let m = Matrix::new(ty, rows, cols, &w).unwrap();
            for n_tok in [1usize, 8] {
                let x = rnd(n_tok * cols);
                let mut out = vec![0f32; n_tok * rows];
                let before = exec.stats();
                for _ in 0..reps {
                    k.matmul(&[m], &x, n_tok, &mut [&mut out]).unwrap();
                }
                let after = exec.stats();
                let cpu = (after.cpu_seconds - before.cpu_seconds) / reps as f64;
                let switches = (after.switches - before.switches) as f64 / reps as f64;
                println!(
                    "{name:>8} {n_tok:>6} {:>6} {:>10.2} {:>14.0} {:>12.1}",
                    format!("{ty}"),
                    cpu * 1e3,
                    switches / rows as f64,
                    cpu * 1e9 / switches
                );
            }
        }
    }
    println!("executor totals: {:?}", exec.stats());
}
