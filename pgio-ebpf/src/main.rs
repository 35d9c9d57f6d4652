//! pgio's kernel side. Data path: tracepoint → histogram map (log2 ns buckets) that
//! userspace reads at scrape time. Every program first finds the current process' series in
//! `TRACKED` and, for syscalls, returns at once when it has none.
#![no_std]
#![no_main]
// `atomic::atomic_add` (BPF_XADD).
#![feature(asm_experimental_arch)]

mod atomic;
mod block_io;
mod drops;
mod floor;
mod hist;
mod hooks;
mod io_worker;
mod kernel_offsets;
mod key_quota;
mod lifecycle;
mod query;
mod query_id;
mod query_wait;
mod queue_blame;
mod relation;
mod role_wait;
mod sys_record;
mod syscall;
mod thread;
mod tracked;
mod wait_event;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

// bpf_probe_read_kernel and the ring buffer helpers are GPL-only.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
