//! The one atomic the kernel side needs, for map values every CPU writes.

/// `*p += v` with BPF_XADD: on every kernel, because the old value is not fetched (that needs
/// the BPF_ATOMIC extension of 5.12). Rust has no atomic read-modify-write for this target.
#[inline(always)]
pub fn atomic_add(p: *mut u64, v: u64) {
    // SAFETY: the caller passes a map value's field, valid while the program runs.
    unsafe {
        core::arch::asm!(
            "lock *(u64 *)({0} + 0) += {1}",
            in(reg) p,
            in(reg) v,
            options(nostack),
        );
    }
}
