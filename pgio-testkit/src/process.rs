//! Looking up processes in /proc.

/// True if /proc/<pid> exists and is not a zombie (an exited process not yet reaped).
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat_fields(&stat).is_some_and(|(state, _)| state != 'Z'),
        Err(_) => false,
    }
}

/// (state, ppid) from a /proc/<pid>/stat line (comm may contain spaces and parens).
pub fn stat_fields(stat: &str) -> Option<(char, u32)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut it = rest.split_whitespace();
    let state = it.next()?.chars().next()?;
    let ppid = it.next()?.parse().ok()?;
    Some((state, ppid))
}

/// PIDs in /proc that satisfy `keep`, sorted.
fn pids_where(keep: impl Fn(u32) -> bool) -> Vec<u32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = rd
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| keep(*pid))
        .collect();
    pids.sort_unstable();
    pids
}

/// PIDs of live processes whose parent is `ppid`.
pub fn processes_with_parent(ppid: u32) -> Vec<u32> {
    pids_where(|pid| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| stat_fields(&s))
            .is_some_and(|(state, p)| p == ppid && state != 'Z')
    })
}

/// PIDs of processes whose command line (args joined by spaces) contains `needle`,
/// e.g. a data directory path to find a leftover postmaster.
pub fn processes_with_cmdline_containing(needle: &str) -> Vec<u32> {
    pids_where(|pid| {
        std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
            String::from_utf8_lossy(&c)
                .replace('\0', " ")
                .contains(needle)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_comm() {
        let stat = "1234 (post gres) (x)) S 77 1234 1234 0 -1 4194560 100 0 0 0";
        assert_eq!(stat_fields(stat), Some(('S', 77)));
    }

    #[test]
    fn finds_own_process() {
        let me = std::process::id();
        let parent = std::os::unix::process::parent_id();
        assert!(processes_with_parent(parent).contains(&me));
        assert!(processes_with_cmdline_containing(&std::env::args().next().unwrap()).contains(&me));
        assert!(pid_alive(me));
        assert!(!pid_alive(u32::MAX));
    }
}
