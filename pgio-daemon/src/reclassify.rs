//! When to look at a freshly forked (or exec'd) process' title again, until it is settled.
use std::{cmp::Reverse, collections::BinaryHeap, time::Duration};

use tokio::time::Instant;

/// The pauses between looks. Dense at first: a new backend sets its title within about a
/// millisecond and reads right after; tokio's timer cannot wait less than 1 ms.
const AFTER: [Duration; 14] = [
    Duration::ZERO,
    Duration::from_millis(1),
    Duration::from_millis(1),
    Duration::from_millis(1),
    Duration::from_millis(1),
    Duration::from_millis(2),
    Duration::from_millis(2),
    Duration::from_millis(4),
    Duration::from_millis(4),
    Duration::from_millis(10),
    Duration::from_millis(25),
    Duration::from_millis(50),
    Duration::from_millis(400),
    Duration::from_millis(1500),
];

/// A look due: the process, and how many looks came before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Look {
    pub pid: u32,
    pub attempt: usize,
}

impl Look {
    /// Whether another look follows this one.
    pub fn has_next(&self) -> bool {
        self.attempt + 1 < AFTER.len()
    }
}

#[derive(Default)]
pub struct Schedule {
    due: BinaryHeap<Reverse<(Instant, u32, usize)>>,
}

impl Schedule {
    pub fn first(&mut self, pid: u32) {
        self.push(pid, 0);
    }

    pub fn next_after(&mut self, look: Look) {
        self.push(look.pid, look.attempt + 1);
    }

    fn push(&mut self, pid: u32, attempt: usize) {
        if let Some(delay) = AFTER.get(attempt) {
            self.due
                .push(Reverse((Instant::now() + *delay, pid, attempt)));
        }
    }

    /// When the next look is due, if any.
    pub fn next_at(&self) -> Option<Instant> {
        self.due.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Takes the next look due by `now`.
    pub fn pop_due(&mut self, now: Instant) -> Option<Look> {
        let Reverse((at, pid, attempt)) = *self.due.peek()?;
        if at > now {
            return None;
        }
        self.due.pop();
        Some(Look { pid, attempt })
    }
}
