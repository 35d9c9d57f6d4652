//! A BTF-defined `BPF_MAP_TYPE_TASK_STORAGE` map: per-thread values that live in the
//! task_struct itself, so a thread finds its own value without hashing, and the kernel frees
//! it with the thread. (aya-ebpf 0.2 has no wrapper for this map type; the layout below is
//! the libbpf `.maps` convention its own BTF maps use.)
use core::ptr;

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_LOCAL_STORAGE_GET_F_CREATE, bpf_map_type},
    helpers::generated::{bpf_get_current_task_btf, bpf_task_storage_get},
};

#[repr(C)]
pub struct TaskStorage<T> {
    r#type: *const [i32; bpf_map_type::BPF_MAP_TYPE_TASK_STORAGE as usize],
    key: *const i32,
    value: *const T,
    max_entries: *const [i32; 0],
    map_flags: *const [i32; BPF_F_NO_PREALLOC as usize],
}

// SAFETY: placeholder pointers the loader replaces; never dereferenced from Rust.
unsafe impl<T> Sync for TaskStorage<T> {}

impl<T> TaskStorage<T> {
    pub const fn new() -> Self {
        TaskStorage {
            r#type: ptr::null(),
            key: ptr::null(),
            value: ptr::null(),
            max_entries: ptr::null(),
            map_flags: ptr::null(),
        }
    }

    #[inline(always)]
    fn current_with(&self, flags: u64) -> Option<*mut T> {
        // SAFETY: the helper takes the map and a trusted task pointer from the kernel.
        let p = unsafe {
            bpf_task_storage_get(
                ptr::from_ref(self).cast_mut().cast(),
                bpf_get_current_task_btf(),
                ptr::null_mut(),
                flags,
            )
        };
        (!p.is_null()).then_some(p.cast())
    }

    /// The current thread's value, created zeroed on first use (None only if the kernel is
    /// out of memory, or another BPF program on this CPU holds the task storage lock).
    #[inline(always)]
    pub fn current_or_zeroed(&self) -> Option<*mut T> {
        self.current_with(BPF_LOCAL_STORAGE_GET_F_CREATE as u64)
    }

    /// The current thread's value if it has one.
    #[inline(always)]
    pub fn current(&self) -> Option<*mut T> {
        self.current_with(0)
    }
}
