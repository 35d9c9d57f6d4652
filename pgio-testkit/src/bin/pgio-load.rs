//! `pgio-load`: a load generator with a known PID for pgio's integration tests.
//!
//! Protocol: all setup (open, size probe, buffer allocation) happens first, then it prints
//! `ready <pid>` on stdout and blocks reading one line from stdin. After any line (e.g. "go")
//! it issues exactly the requested syscalls via libc, prints `done <n>` (n = number of
//! counted syscalls) and exits 0. Any failure exits non-zero with a message on stderr.
//!
//! Subcommands:
//!   direct-read <path> <count> <block_size>   O_DIRECT pread64 x count, sequential, wrapping
//!   pread <path> <n_pread64> <n_preadv>       8 KiB pread64 x N, then 2x4 KiB preadv x M
//!   futex-wait <n> <ms>                        FUTEX_WAIT_BITSET with absolute timeout x n

use std::ffi::CString;
use std::io::{BufRead, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};

const USAGE: &str = "usage:
  pgio-load direct-read <path> <count> <block_size>
  pgio-load pread <path> <n_pread64> <n_preadv>
  pgio-load futex-wait <n> <ms>";

/// `_IOR(0x12, 114, size_t)` from <linux/fs.h>; not exported by the libc crate.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const DIRECT_IO_ALIGN: usize = 4096;
const PREAD_SIZE: usize = 8192;
const PREADV_IOV_SIZE: usize = 4096;

#[derive(Debug, PartialEq, Eq)]
enum Cmd {
    DirectRead {
        path: PathBuf,
        count: u64,
        block_size: usize,
    },
    Pread {
        path: PathBuf,
        n_pread64: u64,
        n_preadv: u64,
    },
    FutexWait {
        n: u64,
        ms: u64,
    },
}

fn parse_num<T: std::str::FromStr>(what: &str, s: &str) -> Result<T> {
    s.parse::<T>()
        .map_err(|_| anyhow::anyhow!("{what}: not a non-negative integer: {s:?}"))
}

fn parse_args(args: &[String]) -> Result<Cmd> {
    let strs: Vec<&str> = args.iter().map(String::as_str).collect();
    match strs.as_slice() {
        ["direct-read", path, count, bs] => {
            let block_size: usize = parse_num("block_size", bs)?;
            ensure!(
                block_size > 0 && block_size.is_multiple_of(512),
                "block_size must be a positive multiple of 512, got {block_size}"
            );
            Ok(Cmd::DirectRead {
                path: PathBuf::from(path),
                count: parse_num("count", count)?,
                block_size,
            })
        }
        ["pread", path, n, m] => Ok(Cmd::Pread {
            path: PathBuf::from(path),
            n_pread64: parse_num("n_pread64", n)?,
            n_preadv: parse_num("n_preadv", m)?,
        }),
        ["futex-wait", n, ms] => Ok(Cmd::FutexWait {
            n: parse_num("n", n)?,
            ms: parse_num("ms", ms)?,
        }),
        _ => bail!("bad arguments: {args:?}"),
    }
}

/// Offset of the `i`-th read when cycling sequentially over `slots` blocks of `block` bytes:
/// no offset repeats before all `slots` offsets were read once.
fn nth_offset(i: u64, slots: u64, block: u64) -> u64 {
    (i % slots) * block
}

/// Absolute CLOCK_MONOTONIC deadline `ms` milliseconds after `now`.
fn deadline_after(now: libc::timespec, ms: u64) -> libc::timespec {
    let total_ns = now.tv_nsec as u64 + (ms % 1000) * 1_000_000;
    libc::timespec {
        tv_sec: now.tv_sec
            + (ms / 1000) as libc::time_t
            + (total_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (total_ns % 1_000_000_000) as libc::c_long,
    }
}

/// A zeroed heap buffer aligned for O_DIRECT.
struct AlignedBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl AlignedBuf {
    fn new(size: usize) -> Result<Self> {
        let layout = std::alloc::Layout::from_size_align(size.max(1), DIRECT_IO_ALIGN)
            .context("buffer layout")?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        ensure!(!ptr.is_null(), "allocating {size} bytes failed");
        Ok(Self { ptr, layout })
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

fn open(path: &Path, flags: libc::c_int) -> Result<Fd> {
    let c = CString::new(path.as_os_str().as_bytes()).context("path contains NUL")?;
    // SAFETY: valid C string.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("open {}", path.display()));
    }
    Ok(Fd(fd))
}

/// Size in bytes of a block device (BLKGETSIZE64) or regular file (fstat).
fn size_of(fd: &Fd, path: &Path) -> Result<u64> {
    // SAFETY: zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out pointer.
    if unsafe { libc::fstat(fd.0, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("fstat {}", path.display()));
    }
    match st.st_mode & libc::S_IFMT {
        libc::S_IFBLK => {
            let mut size: u64 = 0;
            // SAFETY: BLKGETSIZE64 writes one u64.
            if unsafe { libc::ioctl(fd.0, BLKGETSIZE64, &mut size as *mut u64) } != 0 {
                return Err(std::io::Error::last_os_error())
                    .with_context(|| format!("ioctl BLKGETSIZE64 {}", path.display()));
            }
            Ok(size)
        }
        libc::S_IFREG => Ok(st.st_size as u64),
        _ => bail!(
            "{} is neither a block device nor a regular file",
            path.display()
        ),
    }
}

/// Everything set up before `ready`; `execute` issues only the counted syscalls.
enum Prepared {
    DirectRead {
        fd: Fd,
        buf: AlignedBuf,
        count: u64,
        block_size: usize,
        slots: u64,
    },
    Pread {
        fd: Fd,
        buf: AlignedBuf,
        n_pread64: u64,
        n_preadv: u64,
        slots: u64,
    },
    FutexWait {
        n: u64,
        ms: u64,
    },
}

fn prepare(cmd: Cmd) -> Result<Prepared> {
    Ok(match cmd {
        Cmd::DirectRead {
            path,
            count,
            block_size,
        } => {
            let fd = open(&path, libc::O_RDONLY | libc::O_DIRECT)?;
            let size = size_of(&fd, &path)?;
            let slots = size / block_size as u64;
            ensure!(
                slots > 0,
                "{} ({size} bytes) is smaller than one block of {block_size}",
                path.display()
            );
            Prepared::DirectRead {
                fd,
                buf: AlignedBuf::new(block_size)?,
                count,
                block_size,
                slots,
            }
        }
        Cmd::Pread {
            path,
            n_pread64,
            n_preadv,
        } => {
            let fd = open(&path, libc::O_RDONLY)?;
            let size = size_of(&fd, &path)?;
            let slots = (size / PREAD_SIZE as u64).max(1);
            Prepared::Pread {
                fd,
                buf: AlignedBuf::new(PREAD_SIZE)?,
                n_pread64,
                n_preadv,
                slots,
            }
        }
        Cmd::FutexWait { n, ms } => Prepared::FutexWait { n, ms },
    })
}

fn execute(p: Prepared) -> Result<u64> {
    match p {
        Prepared::DirectRead {
            fd,
            buf,
            count,
            block_size,
            slots,
        } => {
            for i in 0..count {
                let off = nth_offset(i, slots, block_size as u64);
                // SAFETY: buf holds block_size bytes.
                let r = unsafe {
                    libc::pread64(fd.0, buf.ptr.cast(), block_size, off as libc::off64_t)
                };
                if r < 0 {
                    return Err(std::io::Error::last_os_error())
                        .with_context(|| format!("pread64 #{i} at offset {off}"));
                }
                ensure!(
                    r as usize == block_size,
                    "pread64 #{i} at offset {off}: short read {r} of {block_size}"
                );
            }
            Ok(count)
        }
        Prepared::Pread {
            fd,
            buf,
            n_pread64,
            n_preadv,
            slots,
        } => {
            for i in 0..n_pread64 {
                let off = nth_offset(i, slots, PREAD_SIZE as u64);
                // SAFETY: buf holds PREAD_SIZE bytes.
                let r = unsafe {
                    libc::pread64(fd.0, buf.ptr.cast(), PREAD_SIZE, off as libc::off64_t)
                };
                if r < 0 {
                    return Err(std::io::Error::last_os_error())
                        .with_context(|| format!("pread64 #{i}"));
                }
            }
            // SAFETY: the two iovecs cover the two halves of buf (2 x 4 KiB = PREAD_SIZE).
            let iov = unsafe {
                [
                    libc::iovec {
                        iov_base: buf.ptr.cast(),
                        iov_len: PREADV_IOV_SIZE,
                    },
                    libc::iovec {
                        iov_base: buf.ptr.add(PREADV_IOV_SIZE).cast(),
                        iov_len: PREADV_IOV_SIZE,
                    },
                ]
            };
            for i in 0..n_preadv {
                let off = nth_offset(i, slots, PREAD_SIZE as u64);
                // SAFETY: iov points into buf, which outlives the call.
                let r = unsafe { libc::preadv(fd.0, iov.as_ptr(), 2, off as libc::off_t) };
                if r < 0 {
                    return Err(std::io::Error::last_os_error())
                        .with_context(|| format!("preadv #{i}"));
                }
            }
            Ok(n_pread64 + n_preadv)
        }
        Prepared::FutexWait { n, ms } => futex_waits(n, ms),
    }
}

fn futex_waits(n: u64, ms: u64) -> Result<u64> {
    let word: u32 = 0;
    let mut eintr = 0u64;
    for i in 0..n {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: valid out pointer (vDSO, not a syscall).
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
        let deadline = deadline_after(now, ms);
        // SAFETY: FUTEX_WAIT_BITSET reads `word` and `deadline`, both live for the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex,
                &word as *const u32,
                libc::FUTEX_WAIT_BITSET | libc::FUTEX_PRIVATE_FLAG,
                0 as libc::c_int,
                &deadline as *const libc::timespec,
                std::ptr::null::<u32>(),
                libc::FUTEX_BITSET_MATCH_ANY,
            )
        };
        ensure!(
            r == -1,
            "futex wait #{i} returned {r} instead of timing out"
        );
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ETIMEDOUT) => {}
            Some(libc::EINTR) => eintr += 1,
            _ => return Err(err).with_context(|| format!("futex wait #{i}")),
        }
    }
    if eintr > 0 {
        eprintln!("pgio-load: {eintr} of {n} futex waits were interrupted (EINTR); counted anyway");
    }
    Ok(n)
}

fn process_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out pointer; CLOCK_PROCESS_CPUTIME_ID always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn run(cmd: Cmd) -> Result<u64> {
    let prepared = prepare(cmd)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready {}", std::process::id()).context("writing ready")?;
    out.flush().context("flushing ready")?;
    let mut line = String::new();
    let n = std::io::stdin()
        .lock()
        .read_line(&mut line)
        .context("reading go line")?;
    ensure!(n > 0, "stdin closed before the go line");
    let cpu_before = process_cpu_ns();
    let done = execute(prepared)?;
    // CPU time of the IO loop alone (user + system, BPF programs on its syscalls included).
    let cpu_ns = process_cpu_ns().saturating_sub(cpu_before);
    writeln!(out, "done {done} {cpu_ns}").context("writing done")?;
    out.flush().context("flushing done")?;
    Ok(done)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = match parse_args(&args) {
        Ok(cmd) => cmd,
        Err(e) => {
            eprintln!("pgio-load: {e:#}\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(cmd) {
        eprintln!("pgio-load: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_subcommands() {
        assert_eq!(
            parse_args(&args("direct-read /dev/loop7 2000 8192")).unwrap(),
            Cmd::DirectRead {
                path: "/dev/loop7".into(),
                count: 2000,
                block_size: 8192
            }
        );
        assert_eq!(
            parse_args(&args("pread /tmp/f 3 4")).unwrap(),
            Cmd::Pread {
                path: "/tmp/f".into(),
                n_pread64: 3,
                n_preadv: 4
            }
        );
        assert_eq!(
            parse_args(&args("futex-wait 5 20")).unwrap(),
            Cmd::FutexWait { n: 5, ms: 20 }
        );
        assert!(
            parse_args(&args("direct-read /dev/x 1 1000")).is_err(),
            "unaligned block size"
        );
        assert!(parse_args(&args("futex-wait -1 20")).is_err());
        assert!(parse_args(&args("futex-wait 1")).is_err());
        assert!(parse_args(&args("nope")).is_err());
    }

    #[test]
    fn offsets_cover_range_before_repeating() {
        let slots = 7;
        let offs: Vec<u64> = (0..slots).map(|i| nth_offset(i, slots, 8192)).collect();
        let mut sorted = offs.clone();
        sorted.dedup();
        assert_eq!(sorted.len() as u64, slots);
        assert_eq!(offs[0], 0);
        assert_eq!(offs[6], 6 * 8192);
        assert_eq!(nth_offset(slots, slots, 8192), 0);
    }

    #[test]
    fn deadline_carries_nanoseconds() {
        let now = libc::timespec {
            tv_sec: 10,
            tv_nsec: 999_000_000,
        };
        let d = deadline_after(now, 1002);
        assert_eq!((d.tv_sec, d.tv_nsec), (12, 1_000_000));
    }

    #[test]
    fn futex_waits_time_out() {
        let t = std::time::Instant::now();
        assert_eq!(futex_waits(3, 10).unwrap(), 3);
        assert!(t.elapsed() >= std::time::Duration::from_millis(30));
    }
}
