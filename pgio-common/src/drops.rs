//! Events the kernel side could not record, counted per reason in the `DROPS` per-CPU array
//! (`pgio_events_dropped_total{reason}`).

crate::abi_enum! {
    /// Counters of events the kernel side could not record, indexed by the discriminant;
    /// `name()` is the `reason` label.
    pub enum DropReason: u32 {
        /// A histogram map was full: the event was not counted.
        HistFull = 0 => "hist_map_full",
        /// The lifecycle ring buffer was full: userspace missed a fork/exec/exit.
        LifecycleRingFull = 1 => "lifecycle_ring_full",
        /// The in-flight request map was full: a request got no submitter.
        InflightFull = 2 => "inflight_map_full",
        /// A thread switched out mid-call found `SYSCALL_SPILLED` full (16,384 threads at
        /// once): its syscall was not timed.
        SyscallStartUnavailable = 3 => "syscall_start_unavailable",
        /// A request completed whose `block_rq_issue` pgio did not see: it is still counted,
        /// on its submitter's series, with its device time measured from `block_io_start` (so
        /// it includes any queue time).
        IssueMissed = 4 => "block_rq_issue_missed",
        /// A completion whose device (`rq->q->disk`) could not be read: the request was not
        /// counted.
        DeviceUnreadable = 5 => "block_device_unreadable",
        /// A process had already sent its titles from `init_ps_display`
        /// (`TITLES_PER_PROCESS`): a further title was not sent, so that one process calling it
        /// in a loop cannot fill the lifecycle ring. Userspace still reads the title from
        /// /proc (its scheduled looks, the rescan).
        TitleOverBudget = 6 => "title_over_budget",
        /// An event needed a new histogram key and its series' owner had used up its share of
        /// the map (`key_quota`): the event was not counted.
        HistOverShare = 7 => "hist_over_share",
        /// `QUERY` was full (16,384 queries running at once on the node): a query was not
        /// timed.
        QueryUnavailable = 8 => "query_unavailable",
        /// An untracked process called `postgres` had told of `EARLY_FORKS_PER_PROCESS` new
        /// processes already: a further one was not told of, so that one process forking in a
        /// loop cannot fill the lifecycle ring. Should its parent be tracked, the rescan
        /// finds the child.
        EarlyForkOverBudget = 9 => "early_fork_over_budget",
    }
}

/// Entries of the `DROPS` array.
pub const DROP_REASONS: usize = DropReason::ALL.len();
