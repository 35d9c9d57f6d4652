//! Where a PostgreSQL backend keeps the id of its query (`pg_stat_activity.query_id`, the id
//! `pg_stat_statements` groups by): `MyBEEntry->st_query_id`, in shared memory. Issue 31 joins
//! query IO to it; this finds the address in a backend, from userspace, without trusting it:
//!
//! - `MyBEEntry` is a dynamic symbol of every `postgres` binary (15-18, Debian's stripped ones
//!   too: extensions link against it). Its file is `/proc/<pid>/exe`, read lazily with
//!   `object`: only the headers and the dynamic symbol table, whatever the binary's size.
//! - Its run-time address: the mapping of that file (same device and inode) at offset 0 in
//!   `/proc/<pid>/maps`, minus the file's first load address (PIE or not).
//! - The pointer there, read from `/proc/<pid>/mem` (ptrace read access: CAP_SYS_PTRACE for
//!   other users' processes), is the backend's entry; `st_query_id` is at a fixed offset of
//!   it per major version ([`QUERY_ID_OFFSET`], measured by `tests/backend_status.rs`).
//!
//! The entry is set once, when the backend starts, and shared memory is mapped at the same
//! address in every backend: the address holds for the backend's life.
use std::{
    fs::File,
    io,
    os::unix::fs::{FileExt, MetadataExt},
};

use object::{Object, ObjectSegment, ObjectSymbol};

/// Binaries larger than this are not parsed (postgres is ~10 MiB).
const MAX_EXE: u64 = 512 << 20;
pub const SYMBOL: &str = "MyBEEntry";
/// Where a backend's wait event is: `uint32 *my_wait_event_info`, which a backend points at
/// its `PGPROC.wait_event_info` once started (`query_wait`). A dynamic symbol of 15-18 too.
pub const WAIT_EVENT_SYMBOL: &str = "my_wait_event_info";
/// What an io worker reads to know whose IO it does (`pgio_common::io_worker`): globals of
/// PostgreSQL 18's binaries (dynamic symbols: extensions use them).
pub const AIO_OWNER_SYMBOLS: [&str; 3] = ["error_context_stack", "ProcGlobal", "MyProcNumber"];

/// PostgreSQL's layouts an io worker is read with, by major version: (offset of
/// `owner_procno` in `PgAioHandle`, `sizeof(PGPROC)`, offset of `PGPROC.pid`). Read off the
/// x86_64 code of 18.6's `pgaio_worker_error_callback` (`movslq 0x10(%rdi)`, index × 832,
/// `mov 0x3c(%rax)`); the kernel checks the worker's own `PGPROC` against its pid at every
/// call, so a build laid out otherwise is counted (`outcome="layout"`), not misbooked.
pub const AIO_LAYOUT: [(u32, (u32, u32, u32)); 1] = [(18, (16, 832, 0x3c))];

pub fn aio_layout(major: u32) -> Option<(u32, u32, u32)> {
    AIO_LAYOUT
        .iter()
        .find(|(m, _)| *m == major)
        .map(|(_, l)| *l)
}

/// Dynamic symbols looked through at most (postgres 15 has 10,796): a crafted binary of a
/// made-up cluster cannot keep the pass busy.
const MAX_SYMBOLS: usize = 1 << 18;

/// Byte offset of `st_query_id` in `PgBackendStatus`, by major version, measured on x86_64
/// (aarch64's LP64 alignment rules give the same layout; not measured there yet).
pub fn query_id_offset(major: u32) -> Option<u64> {
    QUERY_ID_OFFSET
        .iter()
        .find(|(m, _)| *m == major)
        .map(|(_, o)| *o)
}

pub const QUERY_ID_OFFSET: [(u32, u64); 4] = [(15, 424), (16, 424), (17, 424), (18, 424)];

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The address of `MyBEEntry` in process `pid`: a pointer-sized global.
pub fn my_be_entry_symbol(pid: u32) -> io::Result<u64> {
    symbol_addresses(pid, &[SYMBOL])?[0]
        .ok_or_else(|| invalid(format!("/proc/{pid}/exe has no {SYMBOL}")))
}

/// The run-time addresses in process `pid` of the dynamic symbols `names` of its executable
/// (`None`: no such symbol), found in one read of its symbol table.
pub fn symbol_addresses(pid: u32, names: &[&str]) -> io::Result<Vec<Option<u64>>> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(
        format!("/proc/{pid}/exe"),
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )?;
    let exe = File::from(fd);
    let meta = exe.metadata()?;
    if !meta.is_file() || meta.len() > MAX_EXE {
        return Err(invalid(format!(
            "/proc/{pid}/exe: not a regular file of at most {MAX_EXE} bytes"
        )));
    }
    let (dev, ino) = (meta.dev(), meta.ino());
    let cache = object::ReadCache::new(exe);
    let elf = object::File::parse(&cache).map_err(|e| invalid(format!("/proc/{pid}/exe: {e}")))?;
    let mut found: Vec<Option<u64>> = vec![None; names.len()];
    for s in elf.dynamic_symbols().take(MAX_SYMBOLS) {
        if let Ok(name) = s.name()
            && let Some(i) = names.iter().position(|n| *n == name)
        {
            found[i] = Some(s.address());
        }
    }
    if found.iter().all(Option::is_none) {
        return Err(invalid(format!(
            "/proc/{pid}/exe has none of {}",
            names.join(", ")
        )));
    }
    let first_load = elf
        .segments()
        .map(|s| s.address())
        .min()
        .ok_or_else(|| invalid(format!("/proc/{pid}/exe has no segment")))?;
    let process = procfs::process::Process::new(pid as i32)
        .map_err(|e| io::Error::other(format!("/proc/{pid}: {e}")))?;
    let maps = process
        .maps()
        .map_err(|e| io::Error::other(format!("/proc/{pid}/maps: {e}")))?;
    // By device and inode; else by path: on overlayfs (containers) and 9p the maps name the
    // underlying file's device and inode, not those a stat through the mount gives.
    let path = process.exe().ok();
    let by_path = |m: &procfs::process::MemoryMap| matches!((&m.pathname, &path), (procfs::process::MMapPath::Path(p), Some(e)) if p == e);
    let base = maps
        .iter()
        .filter(|m| m.offset == 0)
        .find(|m| m.inode == ino && libc::makedev(m.dev.0 as u32, m.dev.1 as u32) == dev)
        .or_else(|| maps.iter().filter(|m| m.offset == 0).find(|m| by_path(m)))
        .map(|m| m.address.0)
        .ok_or_else(|| invalid(format!("/proc/{pid}/maps: the executable is not mapped")))?;
    // The mapping starts at the first segment's page.
    let page_aligned = first_load & !0xfff;
    Ok(found
        .into_iter()
        .map(|a| a.map(|a| base.wrapping_sub(page_aligned).wrapping_add(a)))
        .collect())
}

/// A u64 of process `pid`'s memory at `addr`.
pub fn read_u64(pid: u32, addr: u64) -> io::Result<u64> {
    let mem = File::open(format!("/proc/{pid}/mem"))?;
    let mut b = [0u8; 8];
    mem.read_exact_at(&mut b, addr)?;
    Ok(u64::from_ne_bytes(b))
}

/// The address of backend `pid`'s `st_query_id`, PostgreSQL `major`; an error for a process
/// that has no backend entry (the postmaster, a process still starting).
pub fn query_id_addr(pid: u32, major: u32) -> io::Result<u64> {
    let off = query_id_offset(major).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::Unsupported,
            format!("PgBackendStatus layout of PostgreSQL {major} unknown"),
        )
    })?;
    let entry = read_u64(pid, my_be_entry_symbol(pid)?)?;
    if entry == 0 {
        return Err(invalid(format!("pid {pid}: {SYMBOL} is NULL")));
    }
    Ok(entry + off)
}
