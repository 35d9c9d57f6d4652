//! Where a release goes: `--registry <host[:port]/repo>`. The image is pushed to
//! `<host>/<repo>:<version>` and the chart to `oci://<host>/<repo's parent>/charts`, a path
//! next to the image's: `registry.example.com/team/pgio` gets its chart at
//! `oci://registry.example.com/team/charts/pgio`. Not `<repo's parent>` itself: the chart is
//! named `pgio` too, and `team/pgio:<version>` would then be the image and the chart at once.

use std::fmt;
use std::str::FromStr;

use anyhow::{Result, bail, ensure};

/// A registry host and the image repository in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// `host` or `host:port`.
    pub host: String,
    /// `pgio`, `team/pgio`: the path under the host, no tag, no digest.
    pub repo: String,
}

impl Target {
    /// `<host>/<repo>`: what `image.repository` becomes.
    pub fn image(&self) -> String {
        format!("{}/{}", self.host, self.repo)
    }

    /// `oci://<host>/<repo's parent>/charts`: where `helm push` sends the chart.
    pub fn chart_repo(&self) -> String {
        match self.repo.rsplit_once('/') {
            Some((parent, _)) => format!("oci://{}/{parent}/charts", self.host),
            None => format!("oci://{}/charts", self.host),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.image())
    }
}

impl FromStr for Target {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Target> {
        let expected = "expected <host[:port]>/<repository>, e.g. registry.example.com/pgio";
        let s = s.trim();
        ensure!(
            !s.contains("://"),
            "--registry {s:?}: no scheme ({expected})"
        );
        let Some((host, repo)) = s.split_once('/') else {
            bail!("--registry {s:?} has no repository ({expected})");
        };
        // Docker's rule: the first component is a host only when it has a dot or a port, or is
        // localhost; anything else would be read as a Docker Hub namespace.
        ensure!(
            host.contains('.') || host.contains(':') || host == "localhost",
            "--registry {s:?}: {host:?} is not a registry host ({expected})"
        );
        ensure!(
            !repo.contains(':') && !repo.contains('@'),
            "--registry {s:?}: no tag or digest, the release tags with pgio's version \
             ({expected})"
        );
        let valid = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-/".contains(c);
        ensure!(
            !repo.is_empty()
                && repo.chars().all(valid)
                && repo.split('/').all(|part| !part.is_empty()),
            "--registry {s:?}: repository {repo:?} must be lowercase path components of \
             a-z, 0-9, '.', '_', '-' ({expected})"
        );
        Ok(Target {
            host: host.to_owned(),
            repo: repo.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_goes_next_to_the_image() {
        let t: Target = "registry.example.com/team/pgio".parse().unwrap();
        assert_eq!(t.image(), "registry.example.com/team/pgio");
        assert_eq!(t.chart_repo(), "oci://registry.example.com/team/charts");
        let t: Target = "127.0.0.1:5000/pgio".parse().unwrap();
        assert_eq!(t.host, "127.0.0.1:5000");
        assert_eq!(t.chart_repo(), "oci://127.0.0.1:5000/charts");
    }

    #[test]
    fn refuses_what_is_not_a_repository() {
        for bad in [
            "pgio",
            "library/pgio",
            "https://registry.example.com/pgio",
            "registry.example.com/",
            "registry.example.com/pgio:0.1.0",
            "registry.example.com/pgio@sha256:00",
            "registry.example.com/PGIO",
            "registry.example.com//pgio",
        ] {
            assert!(bad.parse::<Target>().is_err(), "{bad} was accepted");
        }
    }
}
