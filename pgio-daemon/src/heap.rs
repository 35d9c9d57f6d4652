//! pgio's own heap as the allocator (glibc malloc) counts it, so an RSS step can be told
//! apart: memory pgio holds (`in_use`) against memory malloc keeps after a free (`free`).
//!
//! Start-up (BTF, the eBPF object, the first /proc scan) and big scrapes allocate far more
//! than pgio keeps: measured in the soak, 2 MiB in use beside 24 MiB that malloc kept free
//! and resident. `trim` gives that back; `configure` keeps malloc from opening an arena
//! per thread (up to 8 per CPU), each keeping its own free memory, and serves the scrapes'
//! large buffers (an exposition of ~1 MiB, its growing `Vec`s) from their own mappings, given
//! back at their free, not from the arenas, where they left holes that small allocations
//! pinned: the soak saw the floor after each trim step by 1.1 MiB with the bytes in use flat.
use crate::exposition::{Encoder, Kind, MetricFamily};

/// Arenas malloc may use: the async workers, the scrape threads and the pass thread share
/// them (pgio allocates little on its hot paths, so the arena lock is not contended).
const ARENAS: i32 = 2;

/// Allocations of this size and more get a mapping of their own. Set, it also stops glibc
/// from raising the threshold to the largest block freed so far (up to 32 MiB), which put
/// every later scrape's buffers into the arenas.
const MMAP_THRESHOLD: i32 = 128 << 10;

/// Call before any thread starts.
pub fn configure() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets malloc parameters; no thread allocates concurrently yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, ARENAS);
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

/// Returns the free memory of every arena to the kernel (whole free pages, also those in
/// the middle of an arena).
pub fn trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim locks each arena itself.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Bytes, by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Heap {
    /// Allocated from malloc's arenas and not freed.
    pub in_use: u64,
    /// Free in the arenas: kept by malloc, still resident unless trimmed.
    pub free: u64,
    /// Large allocations malloc serves with their own mmap.
    pub mmapped: u64,
}

impl Heap {
    #[cfg(target_env = "gnu")]
    pub fn read() -> Option<Heap> {
        // SAFETY: mallinfo2 only reads malloc's own statistics (glibc 2.33 and later).
        let m = unsafe { libc::mallinfo2() };
        Some(Heap {
            in_use: m.uordblks as u64,
            free: m.fordblks as u64,
            mmapped: m.hblkhd as u64,
        })
    }

    #[cfg(not(target_env = "gnu"))]
    pub fn read() -> Option<Heap> {
        None
    }

    pub fn encode(&self, enc: &mut Encoder) {
        let mut f = enc.family(&HEAP_BYTES);
        for (state, v) in [
            ("in_use", self.in_use),
            ("free", self.free),
            ("mmapped", self.mmapped),
        ] {
            f.gauge([("state", state)], v as i64);
        }
    }
}

static HEAP_BYTES: MetricFamily = MetricFamily {
    name: "pgio_heap_bytes",
    help: "pgio's heap by malloc's count: in_use (allocated, not freed), free (freed and kept by malloc in its arenas; pgio returns its whole pages to the kernel every 10 s, so most of it is not resident), mmapped (large allocations on their own mappings). Absent where the allocator does not tell.",
    kind: Kind::Gauge,
};
