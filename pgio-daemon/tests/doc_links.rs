//! Every relative link in the repository's Markdown (README.md, BENCHMARKS.md, KERNELS.md,
//! docs/, deploy/) names a file that exists, and every `#anchor` a heading of the file it
//! points into (GitHub's slugs) or an explicit `<a id>`/`<a name>`. Links to other sites are
//! not followed (no network here).
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Markdown files checked.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = ["README.md", "BENCHMARKS.md", "KERNELS.md", "SOAK.md"]
        .iter()
        .map(|f| root.join(f))
        .filter(|p| p.is_file())
        .collect();
    for dir in ["docs", "deploy", "dashboards"] {
        walk(&root.join(dir), &mut out);
    }
    out.sort();
    out
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, out);
        } else if p.extension().is_some_and(|x| x == "md") {
            out.push(p);
        }
    }
}

/// GitHub's anchor of a heading: lowercase, letters, digits, `-` and `_` kept, spaces to
/// `-`, everything else dropped; a repeated one gets `-1`, `-2`, ….
fn slug(text: &str) -> String {
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

struct Doc {
    /// (link target, line) of every link and image.
    links: Vec<(String, usize)>,
    anchors: BTreeSet<String>,
}

fn read(path: &Path) -> Doc {
    let text = std::fs::read_to_string(path).expect("markdown");
    let line_of = |offset: usize| text[..offset].matches('\n').count() + 1;
    let mut links = Vec::new();
    let mut anchors = BTreeSet::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut heading: Option<String> = None;
    for (event, range) in Parser::new_ext(&text, Options::ENABLE_TABLES).into_offset_iter() {
        match event {
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                links.push((dest_url.to_string(), line_of(range.start)));
            }
            Event::Start(Tag::Heading { .. }) => {
                heading = Some(String::new());
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some(h) = heading.take() {
                    let base = slug(&h);
                    let n = seen.entry(base.clone()).or_insert(0);
                    anchors.insert(if *n == 0 {
                        base.clone()
                    } else {
                        format!("{base}-{n}")
                    });
                    *n += 1;
                }
            }
            Event::Html(h) | Event::InlineHtml(h) => {
                for attr in ["id=\"", "name=\""] {
                    for (i, _) in h.match_indices(attr) {
                        let rest = &h[i + attr.len()..];
                        if let Some(end) = rest.find('"') {
                            anchors.insert(rest[..end].to_owned());
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Doc { links, anchors }
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let root = root();
    let docs = documents(&root);
    assert!(docs.len() >= 8, "{} Markdown files", docs.len());
    let mut parsed: BTreeMap<PathBuf, Doc> = BTreeMap::new();
    for d in &docs {
        parsed.insert(d.canonicalize().expect("canonical"), read(d));
    }
    let mut broken = Vec::new();
    let mut checked = 0;
    for d in &docs {
        let here = d.canonicalize().expect("canonical");
        let rel = d.strip_prefix(&root).unwrap_or(d).display().to_string();
        for (target, line) in &parsed[&here].links {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let dest = if file.is_empty() {
                here.clone()
            } else {
                here.parent().expect("dir").join(file)
            };
            let Ok(dest) = dest.canonicalize() else {
                broken.push(format!("{rel}:{line}: {target}: no such file"));
                continue;
            };
            let Some(anchor) = anchor else { continue };
            let anchors = match parsed.get(&dest) {
                Some(doc) => doc.anchors.clone(),
                None if dest.extension().is_some_and(|x| x == "md") => read(&dest).anchors,
                None => {
                    broken.push(format!(
                        "{rel}:{line}: {target}: an anchor into a non-Markdown file"
                    ));
                    continue;
                }
            };
            if !anchors.contains(anchor) {
                broken.push(format!("{rel}:{line}: {target}: no heading #{anchor}"));
            }
        }
    }
    eprintln!("{} files, {checked} relative links", docs.len());
    assert!(checked >= 20, "only {checked} relative links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn slugs_are_githubs() {
    assert_eq!(slug("Query time and IO share"), "query-time-and-io-share");
    assert_eq!(slug("One volume's stack"), "one-volumes-stack");
    assert_eq!(slug("`pgio_query_seconds` (v2)"), "pgio_query_seconds-v2");
    assert_eq!(slug("5. Longhorn facts"), "5-longhorn-facts");
}
