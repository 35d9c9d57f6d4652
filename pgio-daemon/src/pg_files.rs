//! A PostgreSQL cluster's own files, read without trusting them: any process named `postgres`
//! can point pgio at its working directory. Opens stay beneath the data directory with no
//! symlink on the way, never block (a FIFO cannot stall discovery), accept only regular files
//! owned by the directory's owner, and read at most a cap. Heap pages are parsed defensively:
//! a corrupt page yields fewer tuples, never a panic or an out-of-bounds read.
//!
//! Heap page and tuple header layout, and the relation mapper file, are the same in
//! PostgreSQL 15 to 18.
use std::{
    io::Read,
    os::fd::{AsFd, OwnedFd},
    path::Path,
};

pub const BLCKSZ: usize = 8192;
pub const NAMEDATALEN: usize = 64;
const RELMAPPER_MAGIC: u32 = 0x0059_2717;
const MAX_MAPPINGS: usize = 64;
const PAGE_HEADER: usize = 24;
const PG_PAGE_LAYOUT_VERSION: u16 = 4;
const LP_NORMAL: u32 = 1;
const HEAP_XMIN_COMMITTED: u16 = 0x0100;
const HEAP_XMIN_INVALID: u16 = 0x0200;
const HEAP_XMAX_LOCK_ONLY: u16 = 0x0080;
const HEAP_XMAX_COMMITTED: u16 = 0x0400;
const HEAP_XMAX_INVALID: u16 = 0x0800;
/// The fixed tuple header (`HeapTupleHeaderData` up to the null bitmap).
const TUPLE_HEADER: usize = 23;

/// The data directory `data_dir` (pass `/proc/<pid>/cwd` to see through a container's mount
/// namespace), opened as a directory without following a symlink at its last component, and
/// its owner.
pub fn open_data_dir(data_dir: &Path) -> std::io::Result<(OwnedFd, u32)> {
    use rustix::fs::{Mode, OFlags};
    let dir = rustix::fs::open(
        data_dir,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let owner = rustix::fs::fstat(&dir)?.st_uid;
    Ok((dir, owner))
}

/// `rel` beneath `dir`: no symlink anywhere on the way (not to /etc/shadow, not to another
/// cluster's catalogs), non-blocking, only a regular file owned by `owner`.
pub fn open_beneath(dir: impl AsFd, rel: &str, owner: u32) -> std::io::Result<std::fs::File> {
    use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
    let fd = rustix::fs::openat2(
        dir,
        rel,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NOCTTY,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?;
    let st = rustix::fs::fstat(&fd)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile || st.st_uid != owner {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{rel}: not a regular file owned by the data directory's owner"),
        ));
    }
    Ok(std::fs::File::from(fd))
}

/// At most `cap` bytes of `rel` beneath `dir` ([`open_beneath`]).
pub fn read_capped(dir: impl AsFd, rel: &str, owner: u32, cap: u64) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    open_beneath(dir, rel, owner)?
        .take(cap)
        .read_to_end(&mut out)?;
    Ok(out)
}

/// Calls `f` on each page of `file`, at most `max_pages`, one page buffer reused: a catalog of
/// 100,000 tables costs 8 KiB of memory here, not its size. Returns the pages read.
pub fn for_each_page(
    mut file: impl Read,
    max_pages: usize,
    mut f: impl FnMut(&[u8]),
) -> std::io::Result<usize> {
    let mut page = vec![0u8; BLCKSZ];
    for n in 0..max_pages {
        let mut filled = 0;
        while filled < BLCKSZ {
            match file.read(&mut page[filled..])? {
                0 => return Ok(n),
                k => filled += k,
            }
        }
        f(&page);
    }
    Ok(max_pages)
}

/// The relation mapper (`global/pg_filenode.map`, `base/<db>/pg_filenode.map`): mapped
/// catalogs (pg_class itself, the shared ones) have no pg_class row giving their file, and
/// VACUUM FULL moves them to a new one.
pub fn filenode(map: &[u8], oid: u32) -> Option<u32> {
    if u32_at(map, 0)? != RELMAPPER_MAGIC {
        return None;
    }
    let n = (u32_at(map, 4)? as usize).min(MAX_MAPPINGS);
    (0..n).find_map(|i| {
        let off = 8 + i * 8;
        (u32_at(map, off)? == oid)
            .then(|| u32_at(map, off + 4))
            .flatten()
    })
}

pub fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    b.get(off..off.checked_add(4)?)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// A heap tuple as read from a page: its data (after `t_hoff`) and what its header says of
/// its visibility, from hint bits only (pgio cannot read the commit log).
pub struct Tuple<'a> {
    pub data: &'a [u8],
    /// Its deletion (or update) is known committed: a dead version.
    pub deleted: bool,
    /// Its insertion is known aborted.
    pub aborted: bool,
    /// An update whose outcome the hint bits do not tell yet points to a newer version; the
    /// newest points to itself.
    pub newest: bool,
}

/// The tuples of one heap page; nothing for a page that does not look like one.
pub fn heap_tuples(page: &[u8]) -> impl Iterator<Item = Tuple<'_>> + '_ {
    let u16_at = |off: usize| {
        page.get(off..off + 2)
            .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]))
    };
    let sane = page.len() == BLCKSZ
        && u16_at(18) == BLCKSZ as u16 | PG_PAGE_LAYOUT_VERSION
        && (PAGE_HEADER..=BLCKSZ).contains(&(u16_at(12) as usize));
    let lower = if sane {
        u16_at(12) as usize
    } else {
        PAGE_HEADER
    };
    (PAGE_HEADER..lower).step_by(4).filter_map(move |lp_at| {
        let lp = u32_at(page, lp_at)?;
        let (off, flags, len) = ((lp & 0x7fff) as usize, (lp >> 15) & 3, (lp >> 17) as usize);
        if flags != LP_NORMAL || len < TUPLE_HEADER + 1 {
            return None;
        }
        let tuple = page.get(off..off.checked_add(len)?)?;
        let infomask = u16::from_le_bytes([tuple[20], tuple[21]]);
        let hoff = tuple[22] as usize;
        // t_ctid (block hi, block lo, offset) at 12..18 against this line pointer.
        let ctid_offset = u16::from_le_bytes([tuple[16], tuple[17]]) as usize;
        let item = (lp_at - PAGE_HEADER) / 4 + 1;
        let lock_only = infomask & HEAP_XMAX_LOCK_ONLY != 0;
        Some(Tuple {
            data: tuple.get(hoff.max(TUPLE_HEADER)..)?,
            deleted: infomask & HEAP_XMAX_COMMITTED != 0 && !lock_only,
            // Both bits: frozen, i.e. committed long ago.
            aborted: infomask & (HEAP_XMIN_COMMITTED | HEAP_XMIN_INVALID) == HEAP_XMIN_INVALID,
            newest: ctid_offset == item || infomask & HEAP_XMAX_INVALID != 0 || lock_only,
        })
    })
}

/// The NUL-terminated `name` at `off` of a tuple's data.
pub fn name_at(data: &[u8], off: usize) -> Option<&str> {
    let name = data.get(off..off + NAMEDATALEN)?;
    let end = name.iter().position(|&b| b == 0).unwrap_or(NAMEDATALEN);
    std::str::from_utf8(&name[..end]).ok()
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A heap page as PostgreSQL lays it out: one tuple per `(data, infomask)`, each pointing
    /// to itself (t_ctid) unless `infomask` says otherwise.
    pub fn page(tuples: &[(Vec<u8>, u16)]) -> Vec<u8> {
        let mut p = vec![0u8; BLCKSZ];
        let mut upper = BLCKSZ;
        for (i, (data, infomask)) in tuples.iter().enumerate() {
            let hoff = 24usize;
            let len = hoff + data.len();
            upper -= len.next_multiple_of(8);
            let t = &mut p[upper..upper + len];
            t[16..18].copy_from_slice(&(i as u16 + 1).to_le_bytes());
            t[20..22].copy_from_slice(&infomask.to_le_bytes());
            t[22] = hoff as u8;
            t[hoff..].copy_from_slice(data);
            let lp = upper as u32 | LP_NORMAL << 15 | (len as u32) << 17;
            p[24 + 4 * i..28 + 4 * i].copy_from_slice(&lp.to_le_bytes());
        }
        let lower = (24 + 4 * tuples.len()) as u16;
        p[12..14].copy_from_slice(&lower.to_le_bytes());
        p[14..16].copy_from_slice(&(upper as u16).to_le_bytes());
        p[18..20].copy_from_slice(&(BLCKSZ as u16 | PG_PAGE_LAYOUT_VERSION).to_le_bytes());
        p
    }

    /// `oid` then a `name`, as pg_authid, pg_database and pg_namespace start.
    pub fn oid_name(oid: u32, name: &str) -> Vec<u8> {
        let mut d = vec![0u8; 4 + NAMEDATALEN];
        d[..4].copy_from_slice(&oid.to_le_bytes());
        d[4..4 + name.len()].copy_from_slice(name.as_bytes());
        d
    }

    #[test]
    fn tuples_and_their_hint_bits() {
        let p = page(&[
            (oid_name(1, "live"), 0),
            (oid_name(2, "dead"), HEAP_XMAX_COMMITTED),
            (
                oid_name(3, "locked"),
                HEAP_XMAX_COMMITTED | HEAP_XMAX_LOCK_ONLY,
            ),
            (oid_name(4, "aborted"), HEAP_XMIN_INVALID),
            (
                oid_name(5, "frozen"),
                HEAP_XMIN_INVALID | HEAP_XMIN_COMMITTED,
            ),
        ]);
        let t: Vec<(Option<&str>, bool, bool)> = heap_tuples(&p)
            .map(|t| (name_at(t.data, 4), t.deleted, t.aborted))
            .collect();
        assert_eq!(
            t,
            [
                (Some("live"), false, false),
                (Some("dead"), true, false),
                (Some("locked"), false, false),
                (Some("aborted"), false, true),
                (Some("frozen"), false, false),
            ]
        );
    }

    #[test]
    fn an_updated_tuple_is_not_the_newest() {
        let mut p = page(&[(oid_name(1, "old"), 0), (oid_name(1, "new"), 0)]);
        // The first version's t_ctid points to the second.
        let off = (u32_at(&p, 24).unwrap_or(0) & 0x7fff) as usize;
        p[off + 16..off + 18].copy_from_slice(&2u16.to_le_bytes());
        let newest: Vec<bool> = heap_tuples(&p).map(|t| t.newest).collect();
        assert_eq!(newest, [false, true]);
    }

    #[test]
    fn garbage_is_no_tuple() {
        let mut p = page(&[(oid_name(1, "ok"), 0)]);
        // A line pointer past the page end, then one with a too short tuple.
        p[12..14].copy_from_slice(&32u16.to_le_bytes());
        p[28..32].copy_from_slice(&(8000u32 | LP_NORMAL << 15 | 400 << 17).to_le_bytes());
        assert_eq!(heap_tuples(&p).count(), 1);
        assert_eq!(heap_tuples(&[0u8; 100]).count(), 0);
        // Not a page of this layout: nothing.
        p[18..20].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(heap_tuples(&p).count(), 0);
        let noise: Vec<u8> = (0..BLCKSZ).map(|i| (i * 7919 % 251) as u8).collect();
        let _ = heap_tuples(&noise).count();
    }

    #[test]
    fn relation_mapper() {
        let mut map = vec![0u8; 524];
        map[0..4].copy_from_slice(&RELMAPPER_MAGIC.to_le_bytes());
        map[4..8].copy_from_slice(&2u32.to_le_bytes());
        for (i, (oid, node)) in [(1260u32, 1260u32), (1262, 16999)].iter().enumerate() {
            map[8 + 8 * i..12 + 8 * i].copy_from_slice(&oid.to_le_bytes());
            map[12 + 8 * i..16 + 8 * i].copy_from_slice(&node.to_le_bytes());
        }
        assert_eq!(filenode(&map, 1262), Some(16999));
        assert_eq!(filenode(&map, 1260), Some(1260));
        assert_eq!(filenode(&map, 1213), None);
        assert_eq!(filenode(&map[..6], 1260), None);
    }

    #[test]
    fn pages_stop_at_the_cap_and_at_a_short_tail() {
        let file = vec![1u8; 3 * BLCKSZ + 100];
        let mut seen = 0;
        assert_eq!(for_each_page(&file[..], 10, |_| seen += 1).ok(), Some(3));
        assert_eq!(seen, 3);
        assert_eq!(for_each_page(&file[..], 2, |_| {}).ok(), Some(2));
    }
}
