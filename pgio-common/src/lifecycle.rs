//! Process lifecycle events sent to userspace through a ring buffer, so new Postgres
//! backends are classified within milliseconds of their fork.

#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LifecycleKind {
    /// A tracked process forked a new process (not a thread); the child already inherits
    /// the parent's series in the kernel.
    Fork = 0,
    /// Any process called exec: userspace classifies it.
    Exec = 1,
    /// A tracked process exited; the kernel already removed it from the tracked map.
    Exit = 2,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LifecycleEvent {
    pub kind: u32,
    /// The process (tgid) the event is about.
    pub pid: u32,
    /// Fork: the parent's tgid. Otherwise 0.
    pub ppid: u32,
    /// Fork: the series the child starts in (the parent's, or `PROVISIONAL | pid`). Exit: the
    /// series it had. Exec: 0.
    pub series: u32,
}

impl LifecycleKind {
    pub fn from_u32(v: u32) -> Option<LifecycleKind> {
        match v {
            0 => Some(LifecycleKind::Fork),
            1 => Some(LifecycleKind::Exec),
            2 => Some(LifecycleKind::Exit),
            _ => None,
        }
    }
}
