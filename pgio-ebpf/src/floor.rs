//! Benchmark fixture: empty programs for the tracepoints pgio uses for pread64. Their cost is
//! the floor any tracer pays (`cargo xtask bench` compares pgio against it). Loaded only by
//! `pgio-daemon floor`, never by `run`.
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};

#[tracepoint]
pub fn floor_sys_enter_pread64(_ctx: TracePointContext) -> u32 {
    0
}

#[tracepoint]
pub fn floor_sys_exit_pread64(_ctx: TracePointContext) -> u32 {
    0
}
