//! Per-device counters from /proc/diskstats (see the kernel's Documentation/admin-guide/iostats.rst).

use anyhow::{Context, Result, bail};

/// One /proc/diskstats line. Discard and flush fields are 0 on kernels that lack them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskStats {
    pub major: u32,
    pub minor: u32,
    pub reads_completed: u64,
    pub reads_merged: u64,
    pub sectors_read: u64,
    pub time_reading_ms: u64,
    pub writes_completed: u64,
    pub writes_merged: u64,
    pub sectors_written: u64,
    pub time_writing_ms: u64,
    pub ios_in_progress: u64,
    pub time_doing_io_ms: u64,
    pub weighted_time_doing_io_ms: u64,
    pub discards_completed: u64,
    pub discards_merged: u64,
    pub sectors_discarded: u64,
    pub time_discarding_ms: u64,
    pub flushes_completed: u64,
    pub time_flushing_ms: u64,
}

/// Current counters of block device `name` (e.g. "loop3", "vda").
pub fn diskstats(name: &str) -> Result<DiskStats> {
    let text = std::fs::read_to_string("/proc/diskstats").context("reading /proc/diskstats")?;
    parse_all(&text)?
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, s)| s)
        .with_context(|| format!("device {name:?} not in /proc/diskstats"))
}

/// Parses the whole /proc/diskstats text into (name, counters) pairs.
pub fn parse_all(text: &str) -> Result<Vec<(String, DiskStats)>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Result<(String, DiskStats)> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() < 14 {
        bail!("short /proc/diskstats line: {line:?}");
    }
    let n = |i: usize| -> Result<u64> {
        match f.get(i) {
            None => Ok(0),
            Some(v) => v.parse().with_context(|| format!("field {i} of {line:?}")),
        }
    };
    let s = DiskStats {
        major: f[0].parse().with_context(|| format!("major in {line:?}"))?,
        minor: f[1].parse().with_context(|| format!("minor in {line:?}"))?,
        reads_completed: n(3)?,
        reads_merged: n(4)?,
        sectors_read: n(5)?,
        time_reading_ms: n(6)?,
        writes_completed: n(7)?,
        writes_merged: n(8)?,
        sectors_written: n(9)?,
        time_writing_ms: n(10)?,
        ios_in_progress: n(11)?,
        time_doing_io_ms: n(12)?,
        weighted_time_doing_io_ms: n(13)?,
        discards_completed: n(14)?,
        discards_merged: n(15)?,
        sectors_discarded: n(16)?,
        time_discarding_ms: n(17)?,
        flushes_completed: n(18)?,
        time_flushing_ms: n(19)?,
    };
    Ok((f[2].to_owned(), s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_of_all_widths() {
        let text = "\
   7       0 loop0 2013 0 32208 95 0 0 0 0 0 120 95 0 0 0 0 0 0
 254       0 vda 81000 27000 9000000 40000 70000 50000 3000000 90000 2 60000 130000 0 0 0 0 900 70
   8       0 sda 1 2 3 4 5 6 7 8 9 10 11
";
        let all = parse_all(text).unwrap();
        assert_eq!(all.len(), 3);
        let (name, l0) = &all[0];
        assert_eq!(name, "loop0");
        assert_eq!(
            (l0.major, l0.minor, l0.reads_completed, l0.sectors_read),
            (7, 0, 2013, 32208)
        );
        let vda = all[1].1;
        assert_eq!(
            (vda.reads_merged, vda.writes_completed, vda.ios_in_progress),
            (27000, 70000, 2)
        );
        assert_eq!((vda.flushes_completed, vda.time_flushing_ms), (900, 70));
        assert_eq!(all[2].1.weighted_time_doing_io_ms, 11);
        assert_eq!(all[2].1.discards_completed, 0);
        assert!(parse_all("7 0 loop0 1 2").is_err());
    }

    #[test]
    fn reads_live_proc() {
        let text = std::fs::read_to_string("/proc/diskstats").unwrap();
        let all = parse_all(&text).unwrap();
        if let Some((name, _)) = all.first() {
            assert!(diskstats(name).is_ok());
        }
        assert!(diskstats("no-such-device").is_err());
    }
}
