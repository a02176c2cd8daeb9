//! Checksum of KV chunk data: CRC-32C, computed by the kernels crate (which holds the
//! hardware-accelerated code and its one `unsafe` call).

pub use tandem_kernels::checksum::crc32c;
