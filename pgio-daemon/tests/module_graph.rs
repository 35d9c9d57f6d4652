//! The modules of each crate (pgio-daemon, pgio-ebpf, pgio-common, xtask) import each other
//! in one direction only: a file that names
//! `crate::a::b` depends on `a/b.rs` (else `a.rs`), a file of module `a::b` that names
//! `super::c` on `a/c.rs` (else its parent's file); no file may reach itself again. Test code is left out. Found circles are
//! printed file by file.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// Every `.rs` file under `dir`.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("src dir") {
        let path = e.expect("dir entry").path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The file of module path `segments` under `src` (the longest prefix that is a file).
fn module_file(src: &Path, segments: &[&str]) -> Option<PathBuf> {
    (1..=segments.len()).rev().find_map(|n| {
        let dir: PathBuf = segments[..n].iter().collect();
        [
            src.join(&dir).with_extension("rs"),
            src.join(&dir).join("mod.rs"),
        ]
        .into_iter()
        .find(|p| p.is_file())
    })
}

/// Module paths named after `crate::` in `code`, with `{a, b::c}` groups spread out.
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    paths_after(code, "crate::")
}

/// Module paths named after `prefix` (`crate::`, `super::`) in `code`, groups spread out.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices(prefix) {
        let rest = &code[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a, b::{c, d}, e::f}`: the first segment of each entry at depth 0.
            let mut depth = 0;
            let mut entry = String::new();
            for ch in group.chars() {
                match ch {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(segments(&entry));
                        entry.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 || ch != '{' {
                    entry.push(ch);
                }
            }
            out.push(segments(&entry));
        } else {
            out.push(segments(rest));
        }
    }
    out.retain(|p| !p.is_empty());
    out
}

/// Leading `a::b::c` of `text` (module names are lowercase; a type or value ends it).
fn segments(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for seg in text.trim_start().split("::") {
        let name: String = seg
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if name.is_empty() {
            break;
        }
        let whole = name.len() == seg.len();
        out.push(name);
        if !whole {
            break;
        }
    }
    out
}

fn graph(src: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mut all = Vec::new();
    files(src, &mut all);
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for file in &all {
        let text = std::fs::read_to_string(file).expect("source");
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let deps = edges.entry(file.clone()).or_default();
        for path in crate_paths(code) {
            let segs: Vec<&str> = path.iter().map(String::as_str).collect();
            if let Some(dep) = module_file(src, &segs) {
                deps.insert(dep);
            }
        }
        if code.contains("super::") {
            // The module's parent: `a/b.rs` (module `a::b`) → `a`, and `super::c` → `a::c`:
            // `a/c.rs`, else the parent's own file (an item of it).
            let rel = file.strip_prefix(src).expect("under src");
            let mut module: Vec<String> = rel
                .with_extension("")
                .iter()
                .filter_map(|s| s.to_str().map(str::to_owned))
                .collect();
            if module.last().is_some_and(|m| m == "mod") {
                module.pop();
            }
            module.pop();
            let mut named = paths_after(code, "super::");
            named.push(Vec::new());
            for path in named {
                let segs: Vec<&str> = module.iter().chain(&path).map(String::as_str).collect();
                if let Some(dep) = module_file(src, &segs) {
                    deps.insert(dep);
                }
            }
        }
        deps.remove(file);
    }
    edges
}

/// A circle through `start`, if any (depth-first).
fn circle(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>, start: &PathBuf) -> Option<Vec<PathBuf>> {
    fn dfs(
        edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        at: &PathBuf,
        start: &PathBuf,
        path: &mut Vec<PathBuf>,
        seen: &mut BTreeSet<PathBuf>,
    ) -> bool {
        for next in edges.get(at).into_iter().flatten() {
            if next == start {
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if dfs(edges, next, start, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![start.clone()];
    dfs(edges, start, start, &mut path, &mut BTreeSet::new()).then_some(path)
}

/// Each crate's `src`, with how many files it has at least (so that a moved tree fails).
const CRATES: &[(&str, usize)] = &[
    ("pgio-daemon", 40),
    ("pgio-ebpf", 12),
    ("pgio-common", 8),
    ("xtask", 12),
];

#[test]
fn no_module_imports_itself_through_others() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut circles = Vec::new();
    for (krate, at_least) in CRATES {
        let src = root.join(krate).join("src");
        let edges = graph(&src);
        assert!(edges.len() >= *at_least, "{krate}: {} files", edges.len());
        circles.extend(edges.keys().filter_map(|f| circle(&edges, f)).map(|c| {
            let files: Vec<String> = c
                .iter()
                .map(|p| p.strip_prefix(&src).unwrap_or(p).display().to_string())
                .collect();
            format!("{krate}: {}", files.join(" → "))
        }));
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_reader_sees_groups_and_nested_modules() {
    let paths = crate_paths(
        "use crate::{\n    collector::{Scrape, Snapshot},\n    lock,\n    key_quota::plan::Plan,\n};\nlet x = crate::hist::Log2Hist::default();",
    );
    let want: Vec<Vec<&str>> = vec![
        vec!["hist"],
        vec!["collector"],
        vec!["lock"],
        vec!["key_quota", "plan"],
    ];
    let mut got = paths;
    got.sort();
    let mut want: Vec<Vec<String>> = want
        .into_iter()
        .map(|p| p.into_iter().map(str::to_owned).collect())
        .collect();
    want.sort();
    assert_eq!(got, want);
}
