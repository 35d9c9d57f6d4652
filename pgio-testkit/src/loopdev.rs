//! Loop block devices backed by sparse files (`losetup`), detached on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

use crate::cmd;

/// A loop device (`/dev/loopN`) attached to a sparse backing file in a test directory (or to
/// a file the test owns, `attach`). Drop detaches exactly this device (`losetup -d
/// /dev/loopN`), then deletes the file if it created it.
/// Drop any `Ext4Mount` on it first (declare the mount after the device).
#[derive(Debug)]
pub struct LoopDevice {
    path: PathBuf,
    name: String,
    major_minor: (u32, u32),
    size_bytes: u64,
    attached: bool,
    file: PathBuf,
    // Dropped after `Drop::drop` has detached the device; `None` for `attach`.
    backing: Option<tempfile::TempPath>,
}

impl LoopDevice {
    /// Creates a sparse `size_bytes` file in `dir` and attaches it with
    /// `losetup --find --show [--direct-io=on]`. With `direct_io`, fails unless the kernel
    /// actually enabled direct IO (`/sys/block/loopN/loop/dio` = 1), so the device's reads
    /// are not absorbed by the backing file's page cache.
    pub fn create(dir: &Path, size_bytes: u64, direct_io: bool) -> Result<Self> {
        Self::create_backed(dir, size_bytes, direct_io, false)
    }

    /// Like `create`, but every block of the backing file is written (and synced) first, so
    /// the device's reads are real reads of the disk below: a sparse file's holes read as
    /// zeros without any IO, in ~20 µs.
    pub fn create_written(dir: &Path, size_bytes: u64, direct_io: bool) -> Result<Self> {
        Self::create_backed(dir, size_bytes, direct_io, true)
    }

    fn create_backed(dir: &Path, size_bytes: u64, direct_io: bool, written: bool) -> Result<Self> {
        ensure!(
            size_bytes > 0 && size_bytes.is_multiple_of(512),
            "loop size must be a positive multiple of 512"
        );
        let file = tempfile::Builder::new()
            .prefix("pgio-loop-")
            .suffix(".img")
            .tempfile_in(dir)
            .with_context(|| format!("creating backing file in {}", dir.display()))?;
        file.as_file()
            .set_len(size_bytes)
            .with_context(|| format!("sizing {}", file.path().display()))?;
        if written {
            write_all_blocks(file.as_file(), size_bytes)
                .with_context(|| format!("writing {}", file.path().display()))?;
        }
        let backing = file.into_temp_path();
        let mut dev = Self::attach(&backing, direct_io)?;
        dev.backing = Some(backing);
        Ok(dev)
    }

    /// `losetup --find --show [--direct-io=on]` on an existing `file` the caller keeps (e.g.
    /// a FUSE file); the same direct IO check as `create`.
    pub fn attach(file: &Path, direct_io: bool) -> Result<Self> {
        let size_bytes = std::fs::metadata(file)
            .with_context(|| format!("stat {}", file.display()))?
            .len();
        let mut losetup = Command::new("losetup");
        losetup.arg("--find").arg("--show");
        if direct_io {
            losetup.arg("--direct-io=on");
        }
        losetup.arg(file);
        let out = cmd::run(&mut losetup)?;
        let path = PathBuf::from(out.trim());
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| n.starts_with("loop"))
            .with_context(|| format!("unexpected losetup output {out:?}"))?
            .to_owned();
        let mut dev = LoopDevice {
            path,
            name,
            major_minor: (0, 0),
            size_bytes,
            attached: true,
            file: file.to_owned(),
            backing: None,
        };

        dev.major_minor = parse_major_minor(&read_sys(&dev.sys_path("dev"))?)?;
        if direct_io {
            let dio = read_sys(&dev.sys_path("loop/dio"))?;
            ensure!(
                dio.trim() == "1",
                "{}: direct IO requested but loop/dio = {:?} (backing fs without O_DIRECT?)",
                dev.name,
                dio.trim()
            );
        }
        Ok(dev)
    }

    /// `/dev/loopN`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `loopN`, the name in /proc/diskstats and /sys/block.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// (major, minor) from /sys/block/loopN/dev.
    pub fn major_minor(&self) -> (u32, u32) {
        self.major_minor
    }

    /// The device number as the kernel's `dev_t` encoding used by block tracepoints
    /// (`MKDEV(major, minor)` = major << 20 | minor).
    pub fn kernel_dev_t(&self) -> u32 {
        (self.major_minor.0 << 20) | self.major_minor.1
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    pub fn backing_file(&self) -> &Path {
        &self.file
    }

    /// Waits (up to `timeout`) until the device has no IO in flight and its read/write
    /// counters stayed unchanged for 300 ms, e.g. after udev/blkid probing of a new device.
    /// Returns whether it became quiet.
    pub fn wait_quiet(&self, timeout: Duration) -> bool {
        let mut last = None;
        let mut stable_since = std::time::Instant::now();
        crate::wait_until(timeout, Duration::from_millis(50), || {
            let Ok(s) = crate::diskstats(&self.name) else {
                return false;
            };
            let key = (s.reads_completed, s.writes_completed, s.ios_in_progress);
            if last != Some(key) {
                last = Some(key);
                stable_since = std::time::Instant::now();
                return false;
            }
            s.ios_in_progress == 0 && stable_since.elapsed() >= Duration::from_millis(300)
        })
    }

    /// Detaches now, reporting errors (Drop does the same silently, with retries).
    pub fn detach(mut self) -> Result<()> {
        self.try_detach()
    }

    fn try_detach(&mut self) -> Result<()> {
        if !self.attached {
            return Ok(());
        }
        let mut last_err = None;
        for _ in 0..5 {
            match cmd::run(Command::new("losetup").arg("-d").arg(&self.path)) {
                Ok(_) => {
                    self.attached = false;
                    return Ok(());
                }
                Err(e) => last_err = Some(e),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        match last_err {
            Some(e) => Err(e),
            None => bail!("detaching {}", self.path.display()),
        }
    }

    fn sys_path(&self, rel: &str) -> PathBuf {
        Path::new("/sys/block").join(&self.name).join(rel)
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        if let Err(e) = self.try_detach() {
            eprintln!(
                "pgio-testkit: failed to detach {}: {e:#}",
                self.path.display()
            );
        }
    }
}

/// Fills `file` with a non-zero pattern (zeros would do too; a pattern shows in a hexdump that
/// the blocks came from here) and syncs it.
fn write_all_blocks(file: &std::fs::File, size_bytes: u64) -> std::io::Result<()> {
    use std::io::Write;
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8 + 1).collect();
    let mut w = std::io::BufWriter::new(file);
    let mut left = size_bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        w.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    w.flush()?;
    file.sync_all()
}

fn read_sys(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn parse_major_minor(s: &str) -> Result<(u32, u32)> {
    let (ma, mi) = s
        .trim()
        .split_once(':')
        .with_context(|| format!("bad dev string {s:?}"))?;
    Ok((ma.parse().context("major")?, mi.parse().context("minor")?))
}

/// Queue settings of a block device (`/sys/block/<dev>/queue/<knob>`), put back when dropped
/// (also on failure), the last set first: a loop device outlives its attachment, and the next
/// test to attach it (or a benchmark) would inherit them. `scheduler` is put back as the one
/// that was in use.
pub struct QueueKnobs(Vec<(String, String)>);

impl QueueKnobs {
    /// Sets each (knob, value) in order; panics (a test fixture) when one cannot be.
    pub fn set(dev: &str, knobs: &[(&str, &str)]) -> QueueKnobs {
        let mut was = QueueKnobs(Vec::new());
        for (knob, v) in knobs {
            let p = format!("/sys/block/{dev}/queue/{knob}");
            let old = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"));
            // `scheduler` reads as every choice, the one in use bracketed.
            let old = old
                .split_whitespace()
                .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
                .unwrap_or(old.trim());
            was.0.push((p.clone(), old.to_owned()));
            std::fs::write(&p, v).unwrap_or_else(|e| panic!("{p}: {e}"));
        }
        was
    }
}

impl Drop for QueueKnobs {
    fn drop(&mut self) {
        // The last set first: `nr_requests` depends on the scheduler.
        for (p, v) in self.0.iter().rev() {
            if let Err(e) = std::fs::write(p, v) {
                eprintln!("{p}: could not put back {v}: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_major_minor() {
        assert_eq!(super::parse_major_minor("7:12\n").unwrap(), (7, 12));
        assert!(super::parse_major_minor("7-12").is_err());
    }
}
