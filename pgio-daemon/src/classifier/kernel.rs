//! Kernel threads do block IO on behalf of others (writeback, journal, loop devices): they get
//! their own series so that IO never lands on a database process by mistake.
use crate::labels::Labels;

pub fn classify(comm: &str) -> Labels {
    let role = if comm.starts_with("kworker/") {
        "kworker"
    } else if comm.starts_with("jbd2/") {
        "jbd2"
    } else if comm
        .strip_prefix("loop")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    {
        "loop"
    } else {
        "kthread"
    };
    Labels::app_role("kernel", role)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles() {
        assert_eq!(classify("kworker/u8:3").role, "kworker");
        assert_eq!(classify("jbd2/loop3-8").role, "jbd2");
        assert_eq!(classify("loop12").role, "loop");
        assert_eq!(classify("loopback").role, "kthread");
        assert_eq!(classify("kthreadd").role, "kthread");
        assert_eq!(classify("kthreadd").app, "kernel");
    }
}
