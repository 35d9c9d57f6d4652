//! `pgio-load`: a load generator with a known PID for pgio's integration tests.
//!
//! Protocol: all setup (open, size probe, buffer allocation) happens first, then it prints
//! `ready <pid>` on stdout and blocks reading one line from stdin. After any line (e.g. "go")
//! it issues exactly the requested syscalls via libc, prints `done <n> <cpu_ns>` (n = number
//! of counted syscalls, cpu_ns = CPU time of the IO loop), followed by mode-specific
//! `key=value` fields, and exits 0. Any failure exits non-zero with a message on stderr.
//!
//! Subcommands:
//!   direct-read <path> <count> <block_size>   O_DIRECT pread64 x count, sequential, wrapping
//!   pread <path> <n_pread64> <n_preadv>       8 KiB pread64 x N, then 2x4 KiB preadv x M
//!   futex-wait <n> <ms>                        FUTEX_WAIT_BITSET with absolute timeout x n
//!   futex-wake <n>                             FUTEX_WAKE with no waiter x n (never waits)
//!   io-uring <path> <count> <qd> <async|inline>
//!                                              O_DIRECT 8 KiB reads x count through io_uring,
//!                                              at most qd in flight; `async` sets IOSQE_ASYNC
//!                                              on every SQE, so the kernel's io-wq workers
//!                                              (`iou-wrk-<pid>` threads of this process) issue
//!                                              the block IO instead of io_uring_enter itself.
//!                                              n = io_uring_enter calls; extra fields
//!                                              `reads= submitted= completions= bytes=
//!                                              iou_wrk_threads=` (threads alive at the end).
//!
//! io-uring reads go to every other 8 KiB block (offsets 0, 16 KiB, 32 KiB, ...) so that no
//! two reads are adjacent: the block layer can never merge two into one request, and on a
//! device with no other IO the device's read requests equal `reads` exactly.

use std::ffi::CString;
use std::io::{BufRead, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use io_uring::{IoUring, opcode, squeue, types};

const USAGE: &str = "usage:
  pgio-load direct-read <path> <count> <block_size>
  pgio-load pread <path> <n_pread64> <n_preadv>
  pgio-load futex-wait <n> <ms>
  pgio-load futex-wake <n>
  pgio-load io-uring <path> <count> <queue_depth> <async|inline>";

/// `_IOR(0x12, 114, size_t)` from <linux/fs.h>; not exported by the libc crate.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const DIRECT_IO_ALIGN: usize = 4096;
const PREAD_SIZE: usize = 8192;
const PREADV_IOV_SIZE: usize = 4096;
const URING_READ_SIZE: usize = 8192;
/// Distance between two io-uring read offsets: one unread block between reads, no merges.
const URING_STRIDE: u64 = 2 * URING_READ_SIZE as u64;
/// More in flight than io-wq's bounded workers (4 per CPU) or the ring allows is pointless.
const URING_MAX_QD: u32 = 4096;

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
    FutexWake {
        n: u64,
    },
    IoUring {
        path: PathBuf,
        count: u64,
        queue_depth: u32,
        force_async: bool,
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
        ["futex-wake", n] => Ok(Cmd::FutexWake {
            n: parse_num("n", n)?,
        }),
        ["io-uring", path, count, qd, issue] => {
            let queue_depth: u32 = parse_num("queue_depth", qd)?;
            ensure!(
                (1..=URING_MAX_QD).contains(&queue_depth),
                "queue_depth must be 1..={URING_MAX_QD}, got {queue_depth}"
            );
            let force_async = match *issue {
                "async" => true,
                "inline" => false,
                other => bail!("issue mode must be `async` or `inline`, got {other:?}"),
            };
            Ok(Cmd::IoUring {
                path: PathBuf::from(path),
                count: parse_num("count", count)?,
                queue_depth,
                force_async,
            })
        }
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
        /// Opened again after `go` with `PGIO_LOAD_REOPEN` set: an open the tracer sees once it
        /// tracks the process (pgio's relation family names files at their `openat`).
        path: PathBuf,
        buf: AlignedBuf,
        n_pread64: u64,
        n_preadv: u64,
        slots: u64,
    },
    FutexWait {
        n: u64,
        ms: u64,
    },
    FutexWake {
        n: u64,
    },
    IoUring {
        // Declared before `fd`: the ring (and its io-wq workers) goes first.
        ring: Box<IoUring>,
        fd: Fd,
        /// One 8 KiB buffer per queue slot; a slot is reused only after its completion.
        bufs: Vec<AlignedBuf>,
        count: u64,
        force_async: bool,
        slots: u64,
    },
}

/// What `execute` did: the counted syscalls and mode-specific `key=value` fields.
struct Report {
    counted: u64,
    fields: Vec<(&'static str, u64)>,
}

impl From<u64> for Report {
    fn from(counted: u64) -> Self {
        Report {
            counted,
            fields: Vec::new(),
        }
    }
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
                path,
                buf: AlignedBuf::new(PREAD_SIZE)?,
                n_pread64,
                n_preadv,
                slots,
            }
        }
        Cmd::FutexWait { n, ms } => Prepared::FutexWait { n, ms },
        Cmd::FutexWake { n } => Prepared::FutexWake { n },
        Cmd::IoUring {
            path,
            count,
            queue_depth,
            force_async,
        } => {
            let fd = open(&path, libc::O_RDONLY | libc::O_DIRECT)?;
            let size = size_of(&fd, &path)?;
            let slots = size / URING_STRIDE;
            ensure!(
                slots > 0,
                "{} ({size} bytes) is smaller than {URING_STRIDE} bytes",
                path.display()
            );
            // Setting up the ring is io_uring_setup, not io_uring_enter: not counted.
            let ring = Box::new(IoUring::new(queue_depth).context("io_uring_setup")?);
            let bufs = (0..queue_depth)
                .map(|_| AlignedBuf::new(URING_READ_SIZE))
                .collect::<Result<Vec<_>>>()?;
            Prepared::IoUring {
                ring,
                fd,
                bufs,
                count,
                force_async,
                slots,
            }
        }
    })
}

fn execute(p: Prepared) -> Result<Report> {
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
            Ok(count.into())
        }
        Prepared::Pread {
            fd,
            path,
            buf,
            n_pread64,
            n_preadv,
            slots,
        } => {
            let fd = if std::env::var_os("PGIO_LOAD_REOPEN").is_some() {
                open(&path, libc::O_RDONLY)?
            } else {
                fd
            };
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
            Ok((n_pread64 + n_preadv).into())
        }
        Prepared::FutexWait { n, ms } => futex_waits(n, ms),
        Prepared::FutexWake { n } => futex_wakes(n).map(Report::from),
        Prepared::IoUring {
            mut ring,
            fd,
            bufs,
            count,
            force_async,
            slots,
        } => {
            let r = match uring_reads(&mut ring, &fd, &bufs, count, force_async, slots) {
                Ok(r) => r,
                Err(e) => {
                    // Reads may still be in flight into these buffers: never free them.
                    std::mem::forget(bufs);
                    return Err(e);
                }
            };
            // io-wq workers idle for seconds before they exit: the ones that did the reads
            // are still there.
            let threads = iou_wrk_threads().context("listing /proc/self/task")?;
            Ok(Report {
                counted: r.enters,
                fields: vec![
                    ("reads", count),
                    ("submitted", r.submitted),
                    ("completions", r.completions),
                    ("bytes", r.bytes),
                    ("iou_wrk_threads", threads),
                ],
            })
        }
    }
}

struct UringResult {
    /// io_uring_enter syscalls made, failed ones (EINTR, EAGAIN, EBUSY) included.
    enters: u64,
    /// SQEs the kernel consumed, as io_uring_enter returned.
    submitted: u64,
    completions: u64,
    bytes: u64,
}

/// `count` 8 KiB reads through `ring`, at most `bufs.len()` in flight: fill the submission
/// queue, then one `io_uring_enter(to_submit, min_complete = 1, GETEVENTS)` that submits and
/// waits, then reap every completion there is. Each `submit_and_wait` is exactly one
/// io_uring_enter (no SQPOLL), and nothing else here enters the ring.
fn uring_reads(
    ring: &mut IoUring,
    fd: &Fd,
    bufs: &[AlignedBuf],
    count: u64,
    force_async: bool,
    slots: u64,
) -> Result<UringResult> {
    let flags = if force_async {
        squeue::Flags::ASYNC
    } else {
        squeue::Flags::empty()
    };
    let mut free: Vec<usize> = (0..bufs.len()).rev().collect();
    let mut offsets = vec![0u64; bufs.len()];
    let mut res = UringResult {
        enters: 0,
        submitted: 0,
        completions: 0,
        bytes: 0,
    };
    let mut next = 0u64;
    while res.completions < count {
        {
            let mut sq = ring.submission();
            while next < count {
                let Some(slot) = free.pop() else { break };
                let off = nth_offset(next, slots, URING_STRIDE);
                offsets[slot] = off;
                let sqe =
                    opcode::Read::new(types::Fd(fd.0), bufs[slot].ptr, URING_READ_SIZE as u32)
                        .offset(off)
                        .build()
                        .flags(flags)
                        .user_data(slot as u64);
                // SAFETY: the buffer of `slot` stays allocated and untouched until the
                // completion carrying `slot` is reaped; the fd outlives the ring's use.
                unsafe { sq.push(&sqe) }
                    .map_err(|_| anyhow::anyhow!("submission queue full at read #{next}"))?;
                next += 1;
            }
        }
        res.enters += 1;
        match ring.submit_and_wait(1) {
            Ok(n) => res.submitted += n as u64,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) => {}
            Err(e) => {
                return Err(e).with_context(|| format!("io_uring_enter #{}", res.enters));
            }
        }
        for cqe in ring.completion() {
            let slot = cqe.user_data() as usize;
            ensure!(
                slot < bufs.len(),
                "completion with unknown user_data {slot}"
            );
            let r = cqe.result();
            if r < 0 {
                return Err(std::io::Error::from_raw_os_error(-r))
                    .with_context(|| format!("io_uring read at offset {}", offsets[slot]));
            }
            ensure!(
                r as usize == URING_READ_SIZE,
                "io_uring read at offset {}: short read {r} of {URING_READ_SIZE}",
                offsets[slot]
            );
            res.completions += 1;
            res.bytes += r as u64;
            free.push(slot);
        }
    }
    Ok(res)
}

/// Threads of this process whose name starts with `iou-wrk-` (io_uring's io-wq workers).
fn iou_wrk_threads() -> Result<u64> {
    let mut n = 0;
    for entry in std::fs::read_dir("/proc/self/task")? {
        let comm = std::fs::read_to_string(entry?.path().join("comm")).unwrap_or_default();
        if comm.starts_with("iou-wrk-") {
            n += 1;
        }
    }
    Ok(n)
}

/// Bounds of the histogram buckets around a 2 ms wait (2^20 and 2^22 ns): the load's own
/// clock says how many of its waits fell outside them (`under_1ms`, `over_4ms` on the done
/// line), so a test can tell an emulator's late timers from pgio's measurement.
const FUTEX_LOW_NS: u64 = 1 << 20;
const FUTEX_HIGH_NS: u64 = 1 << 22;

fn monotonic() -> libc::timespec {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out pointer (vDSO, not a syscall).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now
}

fn ns_between(a: libc::timespec, b: libc::timespec) -> u64 {
    let ns = |t: libc::timespec| t.tv_sec as i128 * 1_000_000_000 + t.tv_nsec as i128;
    u64::try_from(ns(b) - ns(a)).unwrap_or(0)
}

fn futex_waits(n: u64, ms: u64) -> Result<Report> {
    let word: u32 = 0;
    let mut eintr = 0u64;
    let (mut under, mut over) = (0u64, 0u64);
    for i in 0..n {
        let now = monotonic();
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
        // Read before anything else can run: the wait as this process saw it (a little more
        // than its syscall's time).
        let took = ns_between(now, monotonic());
        ensure!(
            r == -1,
            "futex wait #{i} returned {r} instead of timing out"
        );
        if took <= FUTEX_LOW_NS {
            under += 1;
        } else if took > FUTEX_HIGH_NS {
            over += 1;
        }
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
    Ok(Report {
        counted: n,
        fields: vec![("under_1ms", under), ("over_4ms", over)],
    })
}

fn futex_wakes(n: u64) -> Result<u64> {
    let word: u32 = 0;
    for i in 0..n {
        // SAFETY: FUTEX_WAKE only hashes the address of `word`, which lives for the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex,
                &word as *const u32,
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                1 as libc::c_int,
            )
        };
        ensure!(
            r == 0,
            "futex wake #{i} returned {r}: nobody waits on this word"
        );
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
    let report = execute(prepared)?;
    // CPU time of the IO loop alone (user + system, BPF programs on its syscalls included).
    let cpu_ns = process_cpu_ns().saturating_sub(cpu_before);
    let mut line = format!("done {} {cpu_ns}", report.counted);
    for (k, v) in &report.fields {
        line.push_str(&format!(" {k}={v}"));
    }
    writeln!(out, "{line}").context("writing done")?;
    out.flush().context("flushing done")?;
    Ok(report.counted)
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
        assert_eq!(
            parse_args(&args("io-uring /dev/loop7 5000 8 async")).unwrap(),
            Cmd::IoUring {
                path: "/dev/loop7".into(),
                count: 5000,
                queue_depth: 8,
                force_async: true
            }
        );
        assert_eq!(
            parse_args(&args("io-uring /f 1 1 inline")).unwrap(),
            Cmd::IoUring {
                path: "/f".into(),
                count: 1,
                queue_depth: 1,
                force_async: false
            }
        );
        assert!(parse_args(&args("io-uring /f 1 0 async")).is_err(), "qd 0");
        assert!(parse_args(&args("io-uring /f 1 8 sometimes")).is_err());
        assert!(parse_args(&args("io-uring /f 1 8")).is_err());
    }

    #[test]
    fn io_uring_reads_complete_every_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, vec![3u8; 64 * 1024]).unwrap();
        for force_async in [false, true] {
            let cmd = Cmd::IoUring {
                path: path.clone(),
                count: 10,
                queue_depth: 3,
                force_async,
            };
            let prepared = match prepare(cmd) {
                Ok(p) => p,
                // No O_DIRECT on this filesystem, or io_uring disabled (sandbox, sysctl).
                Err(e) => return eprintln!("skipped: {e:#}"),
            };
            let r = execute(prepared).unwrap();
            let field = |k: &str| r.fields.iter().find(|(n, _)| *n == k).unwrap().1;
            assert_eq!(field("reads"), 10);
            assert_eq!(field("submitted"), 10);
            assert_eq!(field("completions"), 10);
            assert_eq!(field("bytes"), 10 * URING_READ_SIZE as u64);
            // At most 3 in flight: at least ceil(10 / 3) submit-and-wait calls.
            assert!((4..=10).contains(&r.counted), "{} enters", r.counted);
        }
    }

    #[test]
    fn io_uring_offsets_are_never_adjacent() {
        let slots = 5;
        let offs: Vec<u64> = (0..slots)
            .map(|i| nth_offset(i, slots, URING_STRIDE))
            .collect();
        for w in offs.windows(2) {
            assert!(w[1] - w[0] > URING_READ_SIZE as u64);
        }
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
        let r = futex_waits(3, 10).unwrap();
        assert_eq!(r.counted, 3);
        assert!(t.elapsed() >= std::time::Duration::from_millis(30));
        // 10 ms waits are all above 4 ms by the load's own clock.
        assert_eq!(r.fields, [("under_1ms", 0), ("over_4ms", 3)]);
    }
}
