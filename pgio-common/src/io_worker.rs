//! PostgreSQL 18's io workers do reads for other backends (`io_method = worker`, the
//! default). While an io worker serves an IO handle, its IO syscalls are booked under the
//! series of the backend that owns the handle, so that syscall, relation and block series
//! keep the client's labels (issue 47, item 4).
//!
//! The worker's own memory says whom it serves: `IoWorkerMain` pushes an error context whose
//! `arg` is the handle being served (NULL between IOs) onto the global `error_context_stack`;
//! the handle's `owner_procno` indexes `ProcGlobal->allProcs`, whose `pid` is the owner. Each
//! read is checked: the worker's own `PGPROC` (at `MyProcNumber`) must hold its own pid, so a
//! `PGPROC` layout pgio has wrong is counted (`layout`), never booked on someone else; the
//! owner must be a process of the same postmaster.

crate::abi_enum! {
    /// What became of an io worker's IO syscall, indexed by the discriminant in
    /// `IO_WORKER_CALLS`; `name()` is the `outcome` label.
    pub enum Outcome: u32 {
        /// Booked under the series of the backend that owns the handle.
        Attributed = 0 => "attributed",
        /// No handle being served (the worker's own IO): booked under the worker.
        OwnIo = 1 => "own_io",
        /// The owner is not a tracked process of the worker's postmaster (exited, not
        /// classified yet, or a made-up value): booked under the worker.
        OwnerUnknown = 2 => "owner_unknown",
        /// The worker's own `PGPROC` did not hold its pid: the layout pgio assumes for this
        /// build is wrong; booked under the worker.
        Layout = 3 => "layout",
        /// A read of the worker's memory failed: booked under the worker.
        Unreadable = 4 => "unreadable",
        /// pgio has not found where the worker's postmaster keeps these (not yet, or a
        /// binary without the symbols): booked under the worker.
        NotFound = 5 => "not_found",
    }
}

/// Entries of `IO_WORKER_CALLS`.
pub const OUTCOMES: usize = Outcome::ALL.len();

/// Offset of `arg` in PostgreSQL's `ErrorContextCallback` (`previous`, `callback`, `arg`).
pub const ERROR_CONTEXT_ARG_AT: u64 = 16;
