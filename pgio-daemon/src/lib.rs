//! pgio-daemon's library: everything but the command line, so benchmarks and tests can reach
//! the userspace hot spots (classifier, /proc scan, exposition).
//!
//! Data path: probes (pgio-ebpf) → kernel maps → a `collector::Source` per probe family
//! (`families::FAMILIES`: `block_io`, `syscall`, `query`, `lifecycle`; the contract is
//! `family`) → `exposition` → `/metrics`; `discovery` (with `lifecycle` and the
//! `classifier`) keeps the kernel's `tgid → series` map (`series`) current.
use std::sync::{Mutex, MutexGuard};

pub mod bench_switch;
pub mod block_io;
pub mod btf;
pub mod check;
pub mod classifier;
pub mod collector;
pub mod config;
pub mod device_info;
pub mod devices;
pub mod discovery;
pub mod exposition;
pub mod families;
pub mod family;
pub mod health;
pub mod heap;
pub mod hist;
pub mod http;
pub mod http_server;
pub mod io_worker;
pub mod kernel_offsets;
pub mod key_owners;
pub mod key_quota;
pub mod labels;
pub mod lifecycle;
pub mod lockdown;
pub mod log2_hist;
pub mod map_memory;
pub mod maps;
pub mod native;
pub mod pg_files;
pub mod places;
pub mod pods;
pub mod privileges;
pub mod probes;
pub mod proc_scan;
pub mod provisional;
pub mod query;
pub mod query_id;
pub mod queue_blame;
pub mod reclassify;
pub mod relation;
pub mod role_wait;
pub mod run;
pub mod self_metrics;
pub mod series;
pub mod settings;
pub mod syscall;
pub mod top;
pub mod tracefs;
pub mod tracked_map;
pub mod tracked_processes;
pub mod wait_event;
pub mod web_config;

/// A panic while holding one of pgio's locks leaves plain data that is still consistent
/// enough to read: carry on rather than poison every later scrape.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
