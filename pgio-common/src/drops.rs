//! Events the kernel side could not record, counted per reason in the `DROPS` per-CPU array
//! (`pgio_events_dropped_total{reason}`).

/// Counters of events the kernel side could not record, indexed by [`DropReason`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// A histogram map was full: the event was not counted.
    HistFull = 0,
    /// The lifecycle ring buffer was full: userspace missed a fork/exec/exit.
    LifecycleRingFull = 1,
    /// The in-flight request map was full: a request got no submitter.
    InflightFull = 2,
    /// A thread switched out mid-call found `SYSCALL_SPILLED` full (16,384 threads at once):
    /// its syscall was not timed.
    SyscallStartUnavailable = 3,
    /// A request completed whose `block_rq_issue` pgio did not see: it is still counted, on
    /// its submitter's series, with its device time measured from `block_io_start` (so it
    /// includes any queue time).
    IssueMissed = 4,
    /// A completion whose device (`rq->q->disk`) could not be read: the request was not
    /// counted.
    DeviceUnreadable = 5,
    /// A process had already sent its titles from `init_ps_display` (`TITLES_PER_PROCESS`):
    /// a further title was not sent, so that one process calling it in a loop cannot fill the
    /// lifecycle ring. Userspace still reads the title from /proc (its scheduled looks, the
    /// rescan).
    TitleOverBudget = 6,
    /// An event needed a new histogram key and its series' owner had used up its share of the
    /// map (`key_quota`): the event was not counted.
    HistOverShare = 7,
    /// `QUERY` was full (16,384 queries running at once on the node): a query was not timed.
    QueryUnavailable = 8,
}

pub const DROP_REASONS: usize = 9;

impl DropReason {
    pub const ALL: [DropReason; DROP_REASONS] = [
        DropReason::HistFull,
        DropReason::LifecycleRingFull,
        DropReason::InflightFull,
        DropReason::SyscallStartUnavailable,
        DropReason::IssueMissed,
        DropReason::DeviceUnreadable,
        DropReason::TitleOverBudget,
        DropReason::HistOverShare,
        DropReason::QueryUnavailable,
    ];

    pub const fn reason(self) -> &'static str {
        match self {
            DropReason::HistFull => "hist_map_full",
            DropReason::LifecycleRingFull => "lifecycle_ring_full",
            DropReason::InflightFull => "inflight_map_full",
            DropReason::SyscallStartUnavailable => "syscall_start_unavailable",
            DropReason::IssueMissed => "block_rq_issue_missed",
            DropReason::DeviceUnreadable => "block_device_unreadable",
            DropReason::TitleOverBudget => "title_over_budget",
            DropReason::HistOverShare => "hist_over_share",
            DropReason::QueryUnavailable => "query_unavailable",
        }
    }
}
