use super::*;
use crate::types::GgmlType;

#[test]
fn probe_without_a_driver_is_a_clear_error_not_a_panic() {
    // This machine class (CI) has no NVIDIA driver; on a GPU machine the probe must
    // succeed instead, so the assertion depends on what the loader finds.
    // SAFETY: dlopen attempts only.
    let driver = unsafe { sys::is_culib_present() };
    match probe(0) {
        Err(Error::Cuda(msg)) if !driver => {
            assert!(msg.contains("libcuda.so.1 not found"), "{msg}")
        }
        Ok(info) if driver => assert_eq!(info.ordinal, 0),
        Err(Error::Cuda(msg)) if driver => {
            assert!(msg.contains("no device") || msg.contains("CUDA"), "{msg}")
        }
        other => panic!("driver present: {driver}, probe: {other:?}"),
    }
    match probe(4096) {
        Err(Error::Cuda(msg)) => assert!(
            msg.contains("libcuda.so.1 not found") || msg.contains("no device 4096"),
            "{msg}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(CudaDevice::new(4096).is_err());
}

#[test]
fn kv_pool_sizes_match_the_cpu_layout() {
    // SmolLM2: 30 layers, kv_dim 192, F16 rows of 384 bytes, 16-token blocks.
    let b = DeviceKv::bytes_for(GgmlType::F16, 30, 192, 16, 2048).unwrap();
    assert_eq!(b, 2048 * 16 * 384 * 30 * 2);
    assert_eq!(
        DeviceKv::bytes_for(GgmlType::Q8_0, 1, 64, 4, 3).unwrap(),
        3 * 4 * 68 * 2
    );
    assert!(DeviceKv::bytes_for(GgmlType::F32, usize::MAX, 64, 16, 16).is_err());
    assert!(DeviceKv::bytes_for(GgmlType::Q8_0, 1, 33, 16, 16).is_err());
}
