//! PostgreSQL's wait event names by major version, as `pg_stat_activity` shows them: the
//! tables `pg<major>.tsv` (class byte, event id, name; generated from PostgreSQL's sources,
//! each says from which) are compiled in and read once. A value no table has is `unknown`:
//! never an index out of range, whatever a process wrote into its memory.
use std::{collections::HashMap, sync::LazyLock};

use pgio_common::query_wait::{Part, part_of};

const TABLES: [(u8, &str); 4] = [
    (15, include_str!("pg15.tsv")),
    (16, include_str!("pg16.tsv")),
    (17, include_str!("pg17.tsv")),
    (18, include_str!("pg18.tsv")),
];

/// (major, wait_event_info) → name.
static NAMES: LazyLock<HashMap<(u8, u32), &'static str>> = LazyLock::new(|| {
    let mut names = HashMap::new();
    for (major, table) in TABLES {
        for (info, name) in parse(table) {
            names.insert((major, info), name);
        }
    }
    names
});

/// A table's events: `(class << 24 | id, name)`; lines that are not three fields (comments
/// aside) are skipped, and a unit test holds every line of the shipped tables.
fn parse(table: &'static str) -> impl Iterator<Item = (u32, &'static str)> {
    table
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let mut f = l.split('\t');
            let (class, id, name) = (f.next()?, f.next()?, f.next()?);
            let class = u32::from_str_radix(class.trim_start_matches("0x"), 16).ok()?;
            let id: u32 = id.parse().ok()?;
            (f.next().is_none() && class <= 0xFF && id <= 0xFFFF)
                .then_some((class << 24 | id, name))
        })
}

/// Every (wait_event_type, wait_event) pgio names for PostgreSQL `major`.
pub fn names_of(major: u8) -> Vec<(&'static str, &'static str)> {
    TABLES
        .iter()
        .filter(|(m, _)| *m == major)
        .flat_map(|(_, t)| parse(t))
        .map(|(info, name)| (type_name(info), name))
        .collect()
}

/// `pg_stat_activity.wait_event_type` of `info` (`none`: no event set; `unknown`: unreadable
/// or a class PostgreSQL does not have).
pub fn type_name(info: u32) -> &'static str {
    part_of(info).name()
}

/// `pg_stat_activity.wait_event` of `info` in PostgreSQL `major`.
pub fn event_name(major: u8, info: u32) -> &'static str {
    match part_of(info) {
        Part::NoEvent => "none",
        Part::Unknown => "unknown",
        _ => NAMES.get(&(major, info)).copied().unwrap_or("unknown"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_of_every_table_parses_once() {
        for (major, table) in TABLES {
            let lines = table
                .lines()
                .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
                .count();
            let parsed: Vec<_> = parse(table).collect();
            assert_eq!(parsed.len(), lines, "pg{major}.tsv");
            let distinct: std::collections::HashSet<_> = parsed.iter().map(|p| p.0).collect();
            assert_eq!(distinct.len(), lines, "pg{major}.tsv: an event twice");
            assert!(lines > 200, "pg{major}.tsv: {lines} events");
        }
    }

    #[test]
    fn known_events_by_version() {
        // Lock transactionid (LockTagType 5 in 15 to 18).
        for major in 15..=18 {
            assert_eq!(event_name(major, 0x0300_0005), "transactionid");
            assert_eq!(type_name(0x0300_0005), "Lock");
            assert_eq!(event_name(major, 0), "none");
            assert_eq!(type_name(0), "none");
        }
        // A value no table has, and one of a class PostgreSQL does not use.
        assert_eq!(event_name(17, 0x0A00_FFFF), "unknown");
        assert_eq!(type_name(0x0A00_FFFF), "IO");
        assert_eq!(event_name(17, u32::MAX), "unknown");
        assert_eq!(type_name(u32::MAX), "unknown");
        // An unknown major names nothing.
        assert_eq!(event_name(0, 0x0300_0005), "unknown");
    }
}
