//! The fixed layout of every kernel's `syscalls/sys_enter_*` and `sys_exit_*` records: the
//! arguments as u64s after the 8-byte common header and the syscall number, `ret` likewise.
use aya_ebpf::{EbpfContext, programs::TracePointContext};

pub const ARG0: usize = 16;
pub const ARG1: usize = 24;
pub const ARG2: usize = 32;
pub const RET: usize = 16;

#[inline(always)]
pub fn field(ctx: &TracePointContext, offset: usize) -> u64 {
    // SAFETY: inside the fixed-size syscall record.
    unsafe { *(ctx.as_ptr().add(offset) as *const u64) }
}
