//! pgio-daemon's library: everything but the command line, so benchmarks and tests can reach
//! the userspace hot spots (classifier, /proc scan, exposition).
//!
//! Data path: probes (pgio-ebpf) → kernel maps → collector (`exposition`) → `/metrics`;
//! `discovery` keeps the kernel's `tgid → series` map current.
pub mod block_io;
pub mod check;
pub mod classifier;
pub mod config;
pub mod devices;
pub mod discovery;
pub mod exposition;
pub mod hist;
pub mod http;
pub mod kernel_offsets;
pub mod labels;
pub mod probes;
pub mod provisional;
pub mod series;
pub mod syscall;
pub mod tracefs;
