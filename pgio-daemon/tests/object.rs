//! The embedded eBPF object against what the daemon asks of it, without root: every map,
//! program and global a family (or the core) names exists in the object, and every map and
//! program of the object is named by one. A name only a kernel load would have checked fails
//! here, in every `cargo test`.
use std::collections::BTreeSet;

use object::{Object as _, ObjectSymbol as _};
use pgio_common::key_quota::{QUOTA_MAPS, QuotaMap};
use pgio_daemon::{
    families::FAMILIES,
    probes::{
        self, CORE_GLOBALS, CORE_MAPS, FLOOR_PART_MAPS, FLOOR_PARTS, FLOOR_PROGRAMS, TWIN_PROGRAMS,
    },
};

fn object_bytes() -> Option<&'static [u8]> {
    let bytes = probes::object();
    if bytes.is_empty() {
        // Built with AYA_BUILD_SKIP: no object to check (CI builds it).
        assert!(
            std::env::var_os("AYA_BUILD_SKIP").is_some(),
            "pgio-daemon was built without its eBPF object"
        );
        eprintln!("skipped: built with AYA_BUILD_SKIP, no eBPF object");
        return None;
    }
    Some(bytes)
}

fn set<'a>(names: impl IntoIterator<Item = &'a str>) -> BTreeSet<String> {
    names.into_iter().map(str::to_owned).collect()
}

#[test]
fn every_map_the_daemon_names_is_in_the_object_and_no_other() {
    let Some(bytes) = object_bytes() else { return };
    let obj = aya_obj::Object::parse(bytes).expect("parsing the eBPF object");
    // Sections of globals (.rodata, .bss, .data) are maps to aya, named by their section.
    let in_object: BTreeSet<String> = obj
        .maps
        .keys()
        .filter(|m| !m.starts_with('.'))
        .cloned()
        .collect();
    let mut named = set(CORE_MAPS.iter().chain(FLOOR_PART_MAPS).copied());
    for f in FAMILIES {
        for m in f.maps() {
            assert!(
                named.insert((*m).to_owned()),
                "{m} named twice ({})",
                f.name()
            );
        }
        if let Some(h) = f.hist_map() {
            assert!(f.maps().contains(&h.map), "{}: its histogram map", f.name());
            assert_eq!(h.family, f.name());
        }
    }
    assert_eq!(
        named, in_object,
        "maps named by the daemon vs in the object"
    );
}

#[test]
fn every_program_of_the_table_is_in_the_object_and_no_other() {
    let Some(bytes) = object_bytes() else { return };
    let obj = aya_obj::Object::parse(bytes).expect("parsing the eBPF object");
    let in_object: BTreeSet<String> = obj.programs.keys().cloned().collect();
    let table = probes::table();
    let mut named = BTreeSet::new();
    for (i, p) in table.iter().enumerate() {
        assert!(named.insert(p.program.to_string()), "{} twice", p.program);
        if let Some(needed) = p.requires {
            assert!(
                table[..i].iter().any(|q| q.program == needed),
                "{} requires {needed}, which must come before it in the table",
                p.program
            );
        }
    }
    named.extend(set(TWIN_PROGRAMS.iter().copied()));
    named.extend(set(FLOOR_PROGRAMS.iter().copied()));
    named.extend(set(FLOOR_PARTS.iter().copied()));
    assert_eq!(
        named, in_object,
        "programs named by the daemon vs in the object"
    );
}

#[test]
fn every_global_the_loader_writes_is_in_the_object() {
    let Some(bytes) = object_bytes() else { return };
    let file = object::File::parse(bytes).expect("parsing the eBPF object");
    let symbols: BTreeSet<String> = file
        .symbols()
        .filter_map(|s| s.name().ok().map(str::to_owned))
        .collect();
    let globals = CORE_GLOBALS
        .iter()
        .chain(FAMILIES.iter().flat_map(|f| f.globals()));
    for g in globals {
        assert!(symbols.contains(*g), "global {g} missing from the object");
    }
    // What `setup` writes is what `globals` declares.
    let config = pgio_daemon::config::Config::default();
    for f in FAMILIES {
        let setup = f.setup(&config);
        let written: BTreeSet<&str> = setup.globals.iter().map(|(g, _)| *g).collect();
        let declared: BTreeSet<&str> = f.globals().iter().copied().collect();
        assert_eq!(written, declared, "{}: globals", f.name());
        for (map, _) in &setup.map_sizes {
            assert!(f.maps().contains(map), "{}: sizes {map}", f.name());
        }
    }
}

/// `KEY_ALLOWANCE` holds one row per histogram map, in the order of their quota indices.
#[test]
fn histogram_maps_have_distinct_dense_quota_rows() {
    let quotas: Vec<QuotaMap> = FAMILIES
        .iter()
        .filter_map(|f| f.hist_map())
        .map(|h| h.quota)
        .collect();
    let want: Vec<QuotaMap> = (0..quotas.len() as u32).map(QuotaMap).collect();
    let mut sorted = quotas.clone();
    sorted.sort();
    assert_eq!(sorted, want, "quota rows of {quotas:?}");
    assert!(quotas.len() as u32 <= QUOTA_MAPS);
}

#[test]
fn family_names_are_unique_and_name_their_rooms() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut seen = BTreeSet::new();
    for f in FAMILIES {
        assert!(seen.insert(f.name()), "{} twice", f.name());
        for krate in ["pgio-ebpf", "pgio-common", "pgio-daemon"] {
            let room = root
                .join(krate)
                .join("src")
                .join(format!("{}.rs", f.name()));
            assert!(room.is_file(), "{} has no {}", f.name(), room.display());
        }
    }
}
