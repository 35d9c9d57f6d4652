//! Busy processes that keep CPUs taken during a test: shells we start, killed by PID on drop
//! (also when the test fails).
use std::process::{Child, Command};

/// A shell loop that only spins.
pub const SPIN: &str = "while :; do :; done";
/// A shell loop that forks and execs `/bin/true` back to back (a fork storm on top).
pub const FORK: &str = "while :; do /bin/true; done";

pub struct CpuHogs(Vec<Child>);

impl CpuHogs {
    /// `n` spinning loops.
    pub fn start(n: usize) -> CpuHogs {
        CpuHogs::scripts(&vec![SPIN; n])
    }

    /// One `sh -c` per script.
    pub fn scripts(scripts: &[&str]) -> CpuHogs {
        CpuHogs(
            scripts
                .iter()
                .map(|s| {
                    Command::new("sh")
                        .args(["-c", s])
                        .spawn()
                        .expect("busy loop")
                })
                .collect(),
        )
    }

    /// `n` spinning loops, each in a session of its own: with `sched_autogroup_enabled` the
    /// scheduler shares the CPUs between sessions first, so loops in the test's session would
    /// take only that session's share from a server that runs in its own (`pg_ctl`'s).
    pub fn start_in_own_sessions(n: usize) -> CpuHogs {
        use std::os::unix::process::CommandExt;
        CpuHogs(
            (0..n)
                .map(|_| {
                    let mut c = Command::new("sh");
                    c.args(["-c", SPIN]);
                    // SAFETY: setsid is async-signal-safe; nothing else runs in the child.
                    unsafe {
                        c.pre_exec(|| {
                            libc::setsid();
                            Ok(())
                        });
                    }
                    c.spawn().expect("busy loop")
                })
                .collect(),
        )
    }
}

impl Drop for CpuHogs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
