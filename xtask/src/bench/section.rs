//! A `--block-only`, `--programs-only`, `--pgbench-only` or `--profile-only` run updates its
//! own section of BENCHMARKS.md in place, without a full run's 35 minutes, and says so.
use std::path::Path;

use anyhow::{Context as _, Result};

/// `file`'s section that starts at `heading` replaced by `section`, the rest of the file as it
/// was; `flag` names the run that wrote it.
pub fn rewrite(file: &Path, heading: &str, flag: &str, section: &str) -> Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let day = std::process::Command::new("date")
        .args(["-u", "+%F"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "?".to_owned(), |d| d.trim().to_owned());
    let section = format!(
        "{}\n\nThis section alone: `cargo xtask bench {flag}`, {day} (the rest of the file is \
         the last full run's).\n",
        section.trim()
    );
    let out = spliced(&text, heading, &section)
        .with_context(|| format!("{} has no {heading:?} section", file.display()))?;
    std::fs::write(file, out).with_context(|| format!("writing {}", file.display()))
}

/// `text` with the section that starts at `heading` (up to the next heading of its level or
/// above) replaced by `section`.
fn spliced(text: &str, heading: &str, section: &str) -> Option<String> {
    let start = text.find(&format!("\n{heading}\n"))? + 1;
    let body = start + heading.len();
    // A level-2 section keeps its level-3 subsections.
    let ends: &[&str] = if heading.starts_with("## ") {
        &["\n## "]
    } else {
        &["\n## ", "\n### "]
    };
    let end = ends
        .iter()
        .filter_map(|h| text[body..].find(h).map(|i| body + i + 1))
        .min()
        .unwrap_or(text.len());
    Some(format!("{}{section}\n{}", &text[..start], &text[end..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: &str = "### Block programs per request";

    #[test]
    fn only_its_section_is_replaced() {
        let text = "# pgio\n\n### Map memory\n\nm\n\n### Block programs per request\n\nold\n| a |\n\n\n## 2. Next\n\nkept\n";
        let out = spliced(text, H, "### Block programs per request\n\nnew\n").expect("found");
        assert_eq!(
            out,
            "# pgio\n\n### Map memory\n\nm\n\n### Block programs per request\n\nnew\n\n## 2. Next\n\nkept\n"
        );
        assert!(spliced("# pgio\n", H, "x").is_none());
        // Last in the file.
        let out = spliced(
            "a\n### Block programs per request\nold\n",
            H,
            "### Block programs per request\nnew\n",
        );
        assert_eq!(
            out.as_deref(),
            Some("a\n### Block programs per request\nnew\n\n")
        );
    }

    #[test]
    fn a_level_two_section_keeps_its_subsections() {
        let text = "a\n## 2. pgbench\nold\n### Pairs\nold\n## 3. Next\n";
        let out = spliced(
            text,
            "## 2. pgbench",
            "## 2. pgbench\nnew\n### Pairs\nnew\n",
        );
        assert_eq!(
            out.as_deref(),
            Some("a\n## 2. pgbench\nnew\n### Pairs\nnew\n\n## 3. Next\n")
        );
    }

    #[test]
    fn its_level_four_headings_stay_inside_it() {
        let text = "a\n### Programs\nold\n#### Parts\nold\n## 2. Next\n";
        let out = spliced(text, "### Programs", "### Programs\nnew\n#### Parts\nnew\n");
        assert_eq!(
            out.as_deref(),
            Some("a\n### Programs\nnew\n#### Parts\nnew\n\n## 2. Next\n")
        );
    }
}
