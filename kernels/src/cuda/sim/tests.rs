//! The executor's own tests: CUDA semantics of barriers, shuffles, ballot and atomics in
//! every thread order; the defects it must report (divergent barriers, masks naming
//! returned lanes or read outside, deadlocks, races, out-of-bounds and uninitialized
//! reads); exact intrinsics, single-rounding float operations and half conversions; the
//! driver's rules (captures, modules, launch limits); and its refusal to stand in for a
//! real driver. The kernels are `kernels/cuda-sim/tests/selftest.cu`, compiled by NVRTC
//! and loaded through cudarc, so they take the path the real kernels take.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, DriverError,
    LaunchArgs, LaunchConfig, PushKernelArg, ValidAsZeroBits, sys,
};
use cudarc::nvrtc::Ptx;

use super::*;
use crate::cuda::sources::{self, Source, Target};

const SELFTEST: Source = Source {
    file: "selftest.cu",
    code: include_str!("../../../cuda-sim/tests/selftest.cu"),
};

const ORDERS: [Order; 3] = [Order::Forward, Order::Reverse, Order::Random(7)];

struct Sim {
    exec: &'static Executor,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
}

fn sim(order: Order, checks: bool) -> Sim {
    static IMAGE: OnceLock<Vec<u8>> = OnceLock::new();
    static LIB: OnceLock<()> = OnceLock::new();
    let exec = install().unwrap_or_else(|e| panic!("{e}"));
    LIB.get_or_init(|| {
        exec.load_kernel_library(&library("libtandem_cuda_selftest.so"))
            .unwrap()
    });
    let image = IMAGE.get_or_init(|| {
        sources::compile(&SELFTEST, 9, 0, Target::Cubin).unwrap_or_else(|e| panic!("{e}"))
    });
    exec.set_thread_options(Options { order, checks });
    let ctx = CudaContext::new(0).unwrap();
    // SAFETY: one stream per test, used in order; no cross-stream events needed.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let module = ctx.load_module(Ptx::from_binary(image.clone())).unwrap();
    Sim {
        exec,
        stream,
        module,
    }
}

impl Sim {
    fn func(&self, name: &str) -> CudaFunction {
        self.module.load_function(name).unwrap()
    }

    fn up<T: DeviceRepr + ValidAsZeroBits>(&self, v: &[T]) -> CudaSlice<T> {
        self.stream.clone_htod(v).unwrap()
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> CudaSlice<T> {
        self.stream.alloc_zeros(n).unwrap()
    }

    fn down<T: DeviceRepr + Default + Clone>(&self, s: &CudaSlice<T>) -> Vec<T> {
        self.stream.clone_dtoh(s).unwrap()
    }

    /// Launch `name` on (grid, block) with dynamic shared memory `smem`.
    fn launch<'a>(
        &'a self,
        f: &'a CudaFunction,
        grid: u32,
        block: u32,
        smem: u32,
        args: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> std::result::Result<(), DriverError> {
        let mut b = self.stream.launch_builder(f);
        args(&mut b);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: every caller pushes the arguments of the selftest.cu kernel it launches,
        // in order and with the C types (device buffers for pointers, i32 for int, ...),
        // sized for the indices that kernel computes at this geometry.
        unsafe { b.launch(cfg) }.map(|_| ())
    }

    /// Launch expecting the executor to report a defect; its report.
    fn defect<'a>(
        &'a self,
        f: &'a CudaFunction,
        grid: u32,
        block: u32,
        args: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> String {
        let e = self.launch(f, grid, block, 0, args).unwrap_err();
        assert_eq!(e.0, sys::CUresult::CUDA_ERROR_LAUNCH_FAILED, "{e:?}");
        self.exec.last_error()
    }
}

#[test]
fn barriers_order_every_thread_of_the_block_in_every_order() {
    for order in ORDERS {
        let s = sim(order, true);
        let f = s.func("sim_barrier");
        let (n, rounds) = (256usize, 5i32);
        let mut out = s.zeros::<i32>(2 * n);
        let before = s.exec.stats();
        s.launch(&f, 2, n as u32, 0, |b| {
            b.arg(&mut out).arg(&rounds);
        })
        .unwrap();
        let got = s.down(&out);
        for (i, v) in got.iter().enumerate() {
            let t = i % n;
            assert_eq!(*v as usize, (t + 5) % n + 5, "{order:?} thread {i}");
        }
        let st = s.exec.stats();
        assert!(st.blocks >= before.blocks + 2 && st.switches > before.switches);
        assert!(st.checked_launches > before.checked_launches);
    }
}

#[test]
fn a_missing_barrier_is_a_race_and_its_result_depends_on_the_order() {
    let run = |order| {
        let s = sim(order, false);
        let f = s.func("sim_barrier_missing");
        let mut out = s.zeros::<i32>(64);
        s.launch(&f, 1, 64, 0, |b| {
            b.arg(&mut out).arg(&3i32);
        })
        .unwrap();
        s.down(&out)
    };
    let (fwd, rev) = (run(Order::Forward), run(Order::Reverse));
    assert_ne!(fwd, rev, "the thread order changes the result");
    let s = sim(Order::Forward, true);
    let f = s.func("sim_barrier_missing");
    let mut out = s.zeros::<i32>(64);
    let r = s.defect(&f, 1, 64, |b| {
        b.arg(&mut out).arg(&3i32);
    });
    assert!(
        r.contains("race on shared memory") && r.contains("slot2"),
        "{r}"
    );
    assert!(r.contains("sim_barrier_missing"), "{r}");
}

fn shuffle_model(input: &[i32], kind: usize, width: usize, arg: usize, lane: usize) -> i32 {
    let seg = lane & !(width - 1);
    let src = match kind {
        0 => Some(seg + (arg & (width - 1))),
        1 => lane.checked_sub(arg).filter(|s| *s >= seg),
        2 => Some(lane + arg).filter(|s| *s < seg + width),
        _ => Some(lane ^ arg).filter(|s| *s < seg + width),
    };
    input[src.unwrap_or(lane)]
}

#[test]
fn shuffles_follow_cuda_semantics_for_every_width_and_offset() {
    for order in ORDERS {
        let s = sim(order, true);
        let f = s.func("sim_shuffles");
        let input: Vec<i32> = (0..64).map(|i| i * 7 + 3).collect();
        let din = s.up(&input);
        for arg in [0i32, 1, 5, 17, 31] {
            let mut out = s.zeros::<i32>(2 * 12 * 32);
            s.launch(&f, 1, 64, 0, |b| {
                b.arg(&din).arg(&mut out).arg(&arg);
            })
            .unwrap();
            let got = s.down(&out);
            for warp in 0..2 {
                let w_in = &input[warp * 32..][..32];
                for kind in 0..4 {
                    for (wi, width) in [32usize, 16, 8].into_iter().enumerate() {
                        for lane in 0..32 {
                            let want = shuffle_model(w_in, kind, width, arg as usize, lane);
                            let at = warp * 12 * 32 + (kind * 3 + wi) * 32 + lane;
                            assert_eq!(
                                got[at], want,
                                "{order:?} kind {kind} width {width} arg {arg} lane {lane}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn warp_sum_is_the_butterfly_tree_and_wide_values_shuffle_whole() {
    let s = sim(Order::Random(3), true);
    let f = s.func("sim_warp_sum");
    let input: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
    let din = s.up(&input);
    let (mut out, mut dout) = (s.zeros::<f32>(64), s.zeros::<f64>(64));
    s.launch(&f, 1, 64, 0, |b| {
        b.arg(&din).arg(&mut out).arg(&mut dout);
    })
    .unwrap();
    let (got, dgot) = (s.down(&out), s.down(&dout));
    for warp in 0..2 {
        let mut v: Vec<f32> = input[warp * 32..][..32].to_vec();
        for o in [16, 8, 4, 2, 1] {
            v = (0..32).map(|l| v[l] + v[l ^ o]).collect();
        }
        for l in 0..32 {
            assert_eq!(got[warp * 32 + l].to_bits(), v[l].to_bits(), "lane {l}");
            let src = if l < 31 { l + 1 } else { l };
            assert_eq!(dgot[warp * 32 + l], input[warp * 32 + src] as f64 * 0.5);
        }
    }
}

#[test]
fn ballot_any_and_all() {
    let s = sim(Order::Reverse, true);
    let f = s.func("sim_ballot");
    let mut pred = vec![0i32; 96];
    for i in [0, 5, 31, 33] {
        pred[i] = 1;
    }
    for p in &mut pred[64..96] {
        *p = 2;
    }
    let dp = s.up(&pred);
    let mut out = s.zeros::<u32>(3 * 96);
    s.launch(&f, 1, 96, 0, |b| {
        b.arg(&dp).arg(&mut out);
    })
    .unwrap();
    let got = s.down(&out);
    let want = [
        (1u32 | 1 << 5 | 1 << 31, 1, 0),
        (1 << 1, 1, 0),
        (u32::MAX, 1, 1),
    ];
    for t in 0..96 {
        let (b, any, all) = want[t / 32];
        assert_eq!(&got[3 * t..3 * t + 3], &[b, any, all], "thread {t}");
    }
}

#[test]
fn atomics_are_exact_and_tickets_follow_the_thread_order() {
    let (blocks, threads) = (2usize, 128usize);
    let n = 1000usize;
    let input: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2654435761) >> 7)
        .collect();
    let mut want_hist = [0u32; 16];
    for v in &input {
        want_hist[(*v & 15) as usize] += 1;
    }
    let mut orders = Vec::new();
    for order in ORDERS {
        let s = sim(order, true);
        let f = s.func("sim_atomics");
        let din = s.up(&input);
        let mut hist = s.zeros::<u32>(16);
        let mut counter = s.zeros::<u32>(1);
        let mut ticket_order = s.zeros::<u32>(blocks * threads);
        let mut fsum = s.zeros::<f32>(1);
        let mut imax = s.zeros::<i32>(1);
        let ni = n as i32;
        s.launch(&f, blocks as u32, threads as u32, 0, |b| {
            b.arg(&din)
                .arg(&ni)
                .arg(&mut hist)
                .arg(&mut counter)
                .arg(&mut ticket_order)
                .arg(&mut fsum)
                .arg(&mut imax);
        })
        .unwrap();
        let h = s.down(&hist);
        assert_eq!(h.iter().sum::<u32>(), (blocks * n) as u32);
        for (i, c) in h.iter().enumerate() {
            assert_eq!(*c, want_hist[i] * blocks as u32, "{order:?} bin {i}");
        }
        assert_eq!(s.down(&counter), vec![(blocks * threads) as u32]);
        assert_eq!(s.down(&fsum), vec![0.5 * (blocks * threads) as f32]);
        let want_max = (0..threads).map(|t| (t * 7 % 101) as i32).max().unwrap();
        assert_eq!(s.down(&imax), vec![want_max]);
        let mut ids = s.down(&ticket_order);
        orders.push(ids.clone());
        ids.sort();
        assert_eq!(
            ids,
            (0..(blocks * threads) as u32).collect::<Vec<_>>(),
            "{order:?}"
        );
    }
    let fwd: Vec<u32> = (0..(blocks * threads) as u32).collect();
    let rev: Vec<u32> = (0..blocks as u32)
        .flat_map(|b| {
            (0..threads as u32)
                .rev()
                .map(move |t| b * threads as u32 + t)
        })
        .collect();
    assert_eq!(orders[0], fwd, "forward: warp 0 lane 0 first");
    assert_eq!(orders[1], rev, "reverse, block by block");
    assert!(
        orders[2] != fwd && orders[2] != rev,
        "random: another order"
    );
}

#[test]
fn a_barrier_in_divergent_code_is_reported() {
    for order in [Order::Forward, Order::Reverse] {
        let s = sim(order, false);
        let f = s.func("sim_divergent_barrier");
        let mut out = s.zeros::<i32>(64);
        let r = s.defect(&f, 1, 64, |b| {
            b.arg(&mut out);
        });
        assert!(r.contains("divergent __syncthreads"), "{r}");
        assert!(
            r.contains("selftest.cu:"),
            "the report names the source lines: {r}"
        );
    }
}

#[test]
fn masks_naming_returned_lanes_or_read_outside_are_reported_and_deadlocks_too() {
    for order in ORDERS {
        let s = sim(order, false);
        let mut out = s.zeros::<f32>(32);
        let f = s.func("sim_mask_names_returned_lanes");
        let r = s.defect(&f, 1, 32, |b| {
            b.arg(&mut out);
        });
        assert!(
            r.contains("__shfl_xor_sync") && r.contains("returned"),
            "{order:?}: {r}"
        );
        let f = s.func("sim_shuffle_outside_mask");
        let r = s.defect(&f, 1, 32, |b| {
            b.arg(&mut out);
        });
        assert!(r.contains("not in mask 0x0000ffff"), "{order:?}: {r}");
        let f = s.func("sim_deadlock");
        let r = s.defect(&f, 1, 32, |b| {
            b.arg(&mut out);
        });
        assert!(
            r.contains("deadlock") && r.contains("__syncthreads"),
            "{order:?}: {r}"
        );
    }
}

#[test]
fn warp_synchronous_shared_memory_needs_a_syncwarp() {
    for order in ORDERS {
        let s = sim(order, true);
        let f = s.func("sim_warp_shared");
        let mut out = s.zeros::<f32>(64);
        s.launch(&f, 1, 64, 0, |b| {
            b.arg(&mut out).arg(&1i32);
        })
        .unwrap();
        for (t, v) in s.down(&out).iter().enumerate() {
            assert_eq!(*v, ((t & !31) + (t + 1) % 32) as f32);
        }
        let r = s.defect(&f, 1, 64, |b| {
            b.arg(&mut out).arg(&0i32);
        });
        assert!(
            r.contains("race on shared memory") && r.contains("wbuf"),
            "{r}"
        );
    }
}

#[test]
fn out_of_bounds_and_uninitialized_reads_are_reported() {
    let s = sim(Order::Forward, true);
    let f = s.func("sim_read_past_end");
    let n = 100i32;
    let din = s.up(&vec![1f32; 100]);
    let mut out = s.zeros::<f32>(100);
    let r = s.defect(&f, 1, 128, |b| {
        b.arg(&din).arg(&n).arg(&mut out);
    });
    assert!(
        r.contains("out-of-bounds read of 4 bytes")
            && r.contains("offset 400 of the 400-byte device buffer"),
        "{r}"
    );
    let n = 99i32; // the same kernel within bounds
    s.launch(&f, 1, 128, 0, |b| {
        b.arg(&din).arg(&n).arg(&mut out);
    })
    .unwrap();
    let f = s.func("sim_uninitialized_shared");
    let r = s.defect(&f, 1, 64, |b| {
        b.arg(&mut out).arg(&0i32);
    });
    assert!(
        r.contains("uninitialized shared memory") && r.contains("never"),
        "{r}"
    );
    s.launch(&f, 1, 64, 0, |b| {
        b.arg(&mut out).arg(&1i32);
    })
    .unwrap();
    // Without checks the defect runs (what a GPU would do, reading garbage).
    let s = sim(Order::Forward, false);
    let f = s.func("sim_uninitialized_shared");
    let mut out = s.zeros::<f32>(64);
    s.launch(&f, 1, 64, 0, |b| {
        b.arg(&mut out).arg(&0i32);
    })
    .unwrap();
}

#[test]
fn dynamic_shared_memory_is_the_launch_size_and_checked() {
    let s = sim(Order::Reverse, true);
    let f = s.func("sim_dynamic_smem");
    let n = 1000i32;
    let mut out = s.zeros::<f32>(1000);
    s.launch(&f, 1, 256, 4000, |b| {
        b.arg(&mut out).arg(&n).arg(&0i32);
    })
    .unwrap();
    let got = s.down(&out);
    for (i, v) in got.iter().enumerate() {
        assert_eq!(*v, ((999 - i) * 3) as f32);
    }
    let e = s
        .launch(&f, 1, 256, 4000, |b| {
            b.arg(&mut out).arg(&n).arg(&1i32);
        })
        .unwrap_err();
    assert_eq!(e.0, sys::CUresult::CUDA_ERROR_LAUNCH_FAILED);
    let r = s.exec.last_error();
    assert!(
        r.contains("dynamic shared memory") && r.contains("the launch has 4000"),
        "{r}"
    );
}

#[test]
fn integer_intrinsics_and_float_to_int_rounding_are_exact() {
    let s = sim(Order::Forward, true);
    let f = s.func("sim_intrinsics");
    let a: Vec<i32> = (0..256)
        .map(|i| (i * 0x1f3d5b79u32 as i64) as i32)
        .collect();
    let b: Vec<i32> = (0..256)
        .map(|i| (i * 0x7a4c1e93u32 as i64 + 11) as i32)
        .collect();
    let mut fl: Vec<f32> = (0..256).map(|i| (i as f32 - 128.0) * 0.25).collect();
    fl[..10].copy_from_slice(&[
        0.5,
        1.5,
        2.5,
        -0.5,
        -1.5,
        f32::NAN,
        f32::INFINITY,
        -3e9,
        3e9,
        2147483520.0,
    ]);
    let (da, db, df) = (s.up(&a), s.up(&b), s.up(&fl));
    let mut out = s.zeros::<i32>(6 * 256);
    s.launch(&f, 2, 128, 0, |bb| {
        bb.arg(&da).arg(&db).arg(&df).arg(&mut out);
    })
    .unwrap();
    let got = s.down(&out);
    let rn = |x: f32| -> i32 {
        if x.is_nan() {
            0
        } else {
            x.round_ties_even().clamp(i32::MIN as f32, i32::MAX as f32) as i32
        }
    };
    for t in 0..256 {
        let (x, y) = (a[t].to_le_bytes(), b[t].to_le_bytes());
        let dp: i32 = (0..4).fold(t as i32 * 1000, |acc, k| {
            acc.wrapping_add(x[k] as i8 as i32 * y[k] as i8 as i32)
        });
        let sub = u32::from_le_bytes(std::array::from_fn(|k| x[k].wrapping_sub(y[k])));
        let want = [
            dp,
            sub as i32,
            rn(fl[t]),
            (a[t] as u32).count_ones() as i32,
            (fl[t] * 3.0).to_bits() as i32,
            a[t].min(b[t])
                .wrapping_add((a[t] as u32 & 255).max(7) as i32),
        ];
        assert_eq!(
            &got[6 * t..6 * t + 6],
            &want,
            "thread {t} ({}, {}, {})",
            a[t],
            b[t],
            fl[t]
        );
    }
}

#[test]
fn rounded_float_operations_round_once_each_and_never_fuse() {
    let s = sim(Order::Forward, true);
    let f = s.func("sim_rounded_ops");
    // Bit patterns across every exponent (subnormals, infinities and NaNs included), plus
    // triples where a * b + c rounded twice differs from the fused result: (1 + 2^-12)^2
    // = 1 + 2^-11 + 2^-24 rounds to 1 + 2^-11 (a tie to even), so adding -(1 + 2^-11)
    // gives 0 where an fma gives 2^-24.
    let mut st = 0x2545f4914f6cdd1du64;
    let mut next = || {
        st ^= st << 13;
        st ^= st >> 7;
        st ^= st << 17;
        st as u32
    };
    let mut a: Vec<f32> = (0..1500).map(|_| f32::from_bits(next())).collect();
    let mut b: Vec<f32> = (0..1500).map(|_| f32::from_bits(next())).collect();
    // Operands of similar magnitude too, where the roundings matter most.
    let mut c: Vec<f32> = (0..1500)
        .map(|i| f32::from_bits((next() & 0x807f_ffff) | (120 + i as u32 % 16) << 23))
        .collect();
    for i in 0..500 {
        a[i] = f32::from_bits((a[i].to_bits() & 0x807f_ffff) | (124 + i as u32 % 8) << 23);
        b[i] = f32::from_bits((b[i].to_bits() & 0x807f_ffff) | (124 + i as u32 % 5) << 23);
    }
    let e = 1.0 + f32::EPSILON * 2048.0; // 1 + 2^-12
    let specials = [
        (e, e, -(1.0 + f32::EPSILON * 4096.0)),
        (0.1, 10.0, -1.0),
        (f32::MIN_POSITIVE, 0.5, 0.0),
        (1e-45, 1e-45, -0.0),
        (f32::MAX, 2.0, -f32::MAX),
        (f32::INFINITY, 0.0, 1.0),
        (f32::NAN, 1.0, 1.0),
        (-0.0, 0.0, -0.0),
        (3.0, 0.0, 7.0),
    ];
    for (i, (x, y, z)) in specials.into_iter().enumerate() {
        (a[i * 7], b[i * 7], c[i * 7]) = (x, y, z);
    }
    let n = a.len();
    let n32 = n as i32;
    let (da, db, dc) = (s.up(&a), s.up(&b), s.up(&c));
    let mut out = s.zeros::<f32>(8 * n);
    s.launch(&f, (n as u32).div_ceil(128), 128, 0, |bb| {
        bb.arg(&da).arg(&db).arg(&dc).arg(&mut out).arg(&n32);
    })
    .unwrap();
    let got = s.down(&out);
    let mut fused_differs = 0;
    for t in 0..n {
        let (x, y, z) = (a[t], b[t], c[t]);
        // Rust's f32 operators are single IEEE operations, never contracted.
        let want = [
            x + y,
            x - y,
            x * y,
            x / y,
            x.abs().sqrt(),
            x.mul_add(y, z),
            x * y + z,
            z - x * y,
        ];
        for (k, (g, w)) in got[8 * t..8 * t + 8].iter().zip(want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "operation {k} of ({x:e}, {y:e}, {z:e}): {g:e} ({:#010x}), want {w:e} ({:#010x})",
                g.to_bits(),
                w.to_bits()
            );
        }
        fused_differs += usize::from(want[5].to_bits() != want[6].to_bits() && !want[5].is_nan());
    }
    // The inputs distinguish a fused multiply-add from the two roundings many times over.
    assert_eq!(got[6], 0.0);
    assert_eq!(got[5], f32::EPSILON / 2.0);
    assert!(fused_differs > 100, "{fused_differs}");
}

#[test]
fn half_conversions_match_the_half_crate_bit_for_bit() {
    let s = sim(Order::Forward, false);
    let f = s.func("sim_halves");
    // f32 patterns: every 4096th bit pattern, plus the rounding edges around every f16.
    let mut bits: Vec<u32> = (0..(1u64 << 32)).step_by(4096).map(|b| b as u32).collect();
    for h in (0..0x7c00u16).step_by(7) {
        let v = half::f16::from_bits(h).to_f32().to_bits();
        bits.extend([
            v.wrapping_sub(1),
            v,
            v + 1,
            v + 0x0fff,
            v + 0x1000,
            v + 0x1001,
        ]);
    }
    let n = bits.len() as i32;
    let dbits = s.up(&bits);
    let mut h2f = s.zeros::<f32>(65536);
    let mut f2h = s.zeros::<u16>(bits.len());
    let blocks = (bits.len() as u32).max(65536).div_ceil(256);
    s.launch(&f, blocks, 256, 0, |b| {
        b.arg(&dbits).arg(&mut h2f).arg(&mut f2h).arg(&n);
    })
    .unwrap();
    for (h, got) in s.down(&h2f).iter().enumerate() {
        let want = half::f16::from_bits(h as u16).to_f32();
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "h2f({h:#06x}) = {got:?}, want {want:?}"
        );
    }
    for (i, got) in s.down(&f2h).iter().enumerate() {
        let want = half::f16::from_f32(f32::from_bits(bits[i]));
        assert!(
            *got == want.to_bits() || (want.is_nan() && half::f16::from_bits(*got).is_nan()),
            "f2h({:#010x}) = {got:#06x}, want {:#06x}",
            bits[i],
            want.to_bits()
        );
    }
}

#[test]
fn parameters_of_every_size_arrive_and_graphs_keep_a_copy_of_them() {
    let s = sim(Order::Forward, true);
    let f = s.func("sim_params");
    let mut out = s.zeros::<f32>(300);
    let (mut a, b, c, d, n) = (2.5f32, -3i32, 7u64, 200u8, 300i32);
    let want =
        |a: f32| -> Vec<f32> { (0..300).map(|i| a * i as f32 - 3.0 + 7.0 + 200.0).collect() };
    s.launch(&f, 2, 256, 0, |bb| {
        bb.arg(&mut out).arg(&a).arg(&b).arg(&c).arg(&d).arg(&n);
    })
    .unwrap();
    assert_eq!(s.down(&out), want(2.5));
    s.stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    a = 1.0;
    s.launch(&f, 2, 256, 0, |bb| {
        bb.arg(&mut out).arg(&a).arg(&b).arg(&c).arg(&d).arg(&n);
    })
    .unwrap();
    let graph = s
        .stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .unwrap();
    assert_eq!(s.down(&out), want(2.5), "nothing ran while capturing");
    a = 9.0;
    graph.upload().unwrap();
    graph.launch().unwrap();
    assert_eq!(
        s.down(&out),
        want(1.0),
        "the graph replays the captured value, not {a}"
    );
}

#[test]
fn captures_refuse_copies_allocations_and_synchronization() {
    let s = sim(Order::Forward, false);
    let mut buf = s.zeros::<f32>(16);
    type Op<'a> = Box<dyn Fn(&mut CudaSlice<f32>) -> std::result::Result<(), DriverError> + 'a>;
    let ops: [(&str, Op<'_>); 4] = [
        ("copy", Box::new(|b| s.stream.memcpy_htod(&[1f32; 16], b))),
        (
            "alloc",
            Box::new(|_| s.stream.alloc_zeros::<f32>(4).map(|_| ())),
        ),
        ("memset", Box::new(|b| s.stream.memset_zeros(b))),
        ("synchronize", Box::new(|_| s.stream.synchronize())),
    ];
    for (what, op) in ops {
        s.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let e = op(&mut buf).unwrap_err();
        assert_eq!(
            e.0,
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            "{what}"
        );
        let e = s
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .err()
            .unwrap();
        assert_eq!(
            e.0,
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            "{what}"
        );
        op(&mut buf).unwrap(); // allowed again once the capture ended
    }
}

#[test]
fn modules_check_entry_names_and_parameter_sizes_and_launches_their_limits() {
    let s = sim(Order::Forward, false);
    let e = s.module.load_function("sim_not_a_kernel").unwrap_err();
    assert_eq!(e.0, sys::CUresult::CUDA_ERROR_NOT_FOUND);
    // A PTX image naming a CPU-compiled kernel with the wrong parameters is refused; one
    // naming a kernel no library has is not found.
    let ptx = ".version 8.0\n.target sm_90\n.address_size 64\n\
               .visible .entry sim_params(\n\t.param .u64 sim_params_param_0\n)\n{\n\tret;\n}\n\
               .visible .entry sim_unknown(\n)\n{\n\tret;\n}\n";
    let m = s.stream.context().load_module(Ptx::from_src(ptx)).unwrap();
    assert_eq!(
        m.load_function("sim_params").unwrap_err().0,
        sys::CUresult::CUDA_ERROR_INVALID_IMAGE
    );
    assert_eq!(
        m.load_function("sim_unknown").unwrap_err().0,
        sys::CUresult::CUDA_ERROR_NOT_FOUND
    );
    assert!(
        s.stream
            .context()
            .load_module(Ptx::from_src("not ptx"))
            .is_err()
    );
    let f = s.func("sim_barrier");
    let mut out = s.zeros::<i32>(2048);
    for (block, smem) in [(2048u32, 0u32), (64, 64 * 1024)] {
        let e = s
            .launch(&f, 1, block, smem, |b| {
                b.arg(&mut out).arg(&1i32);
            })
            .unwrap_err();
        assert_eq!(
            e.0,
            sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            "{block} {smem}"
        );
    }
}

#[test]
fn refuses_to_stand_in_where_a_driver_is_present() {
    let dir = std::env::temp_dir().join(format!("tsim-driver-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("version");
    std::fs::write(&fake, "NVRM version: 550.0").unwrap();
    let fake = fake.to_str().unwrap();
    assert_eq!(driver_evidence(&["/nonexistent/a", fake]), Some(fake));
    let e = load(&[fake]).unwrap_err().to_string();
    assert!(e.contains("NVIDIA driver") && e.contains(fake), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    // This machine class has none: the real probe finds the executor.
    assert_eq!(driver_evidence(&DRIVER_EVIDENCE), None);
    install().unwrap();
    let info = crate::cuda::probe(0).unwrap();
    assert_eq!(info.name, "Tandem CUDA executor (CPU)");
    assert_eq!(info.compute_capability, (9, 0));
}

#[test]
fn thread_orders_parse() {
    assert_eq!("forward".parse(), Ok(Order::Forward));
    assert_eq!("reverse".parse(), Ok(Order::Reverse));
    assert_eq!("random:42".parse(), Ok(Order::Random(42)));
    assert!("random:x".parse::<Order>().is_err());
    assert!("sideways".parse::<Order>().is_err());
}
