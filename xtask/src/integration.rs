//! `cargo xtask integration`: pgio's root integration tests on Debian's own kernels, each booted
//! in qemu (TCG) with the host's root filesystem read-only over 9p and a tmpfs overlay
//! (DESIGN.md §7). Kernels come from a private apt state under `target/integration/apt/` and are
//! unpacked, never installed on the host. The tests are the release test binaries the host
//! built, run inside the guest as they are; results come back through a second, writable 9p
//! share and are printed as a table kernel × test.
//!
//! `--arch arm64` boots Debian's arm64 kernels under qemu-system-aarch64 (TCG) the same way; the
//! binaries are cross-compiled, and since the host's root is amd64 the guest's root is built
//! from Debian's arm64 packages (`rootfs.rs`), with the workspace as a second share at its own
//! path. `arch.rs` holds what differs.

mod arch;
mod rootfs;

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};

use crate::cross::{self, Arch};
use crate::util::{describe, fmt_duration, is_root, output, run, step, target_dir};

/// A Debian kernel series pgio is tested on.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    /// `5.10`, `6.1`, `6.12`: the upstream series, and the `--kernel` value.
    pub series: &'static str,
    /// Metapackages whose `Depends` name the current image package of the series; the newest
    /// version of the series wins (package names change with every ABI bump). `{arch}`: the
    /// Debian architecture.
    metapackages: &'static [&'static str],
    /// What pgio lacks on it, for the report.
    pub note: &'static str,
    /// More kernel command line for this series on amd64.
    append_amd64: &'static str,
    /// The guest's architecture (`--arch`).
    pub arch: Arch,
}

impl Kernel {
    /// `6.1` on amd64 (the names the report and the caches had before arm64), `6.1-arm64`.
    pub fn label(&self) -> String {
        match self.arch {
            Arch::Amd64 => self.series.to_owned(),
            a => format!("{}-{}", self.series, a.name()),
        }
    }

    fn guest(&self) -> &'static arch::Guest {
        arch::guest(self.arch)
    }

    /// The series' own kernel command line on its architecture.
    fn append(&self) -> &'static str {
        match self.arch {
            Arch::Amd64 => self.append_amd64,
            _ => "",
        }
    }

    fn metapackages(&self) -> impl Iterator<Item = String> + '_ {
        self.metapackages
            .iter()
            .map(|m| m.replace("{arch}", self.arch.name()))
    }
}

/// 6.1 under TCG otherwise marks the TSC unstable and falls back to a clocksource that makes
/// every timestamp a slow emulated device read.
const TSC_RELIABLE: &str = "tsc=reliable";

pub const KERNELS: &[Kernel] = &[
    Kernel {
        series: "5.10",
        metapackages: &["linux-image-{arch}"],
        note: "bullseye; no block_io_start (6.5), no task storage for tracing (5.11)",
        append_amd64: TSC_RELIABLE,
        arch: Arch::Amd64,
    },
    Kernel {
        series: "6.1",
        metapackages: &["linux-image-{arch}"],
        note: "bookworm; no block_io_start (6.5)",
        append_amd64: TSC_RELIABLE,
        arch: Arch::Amd64,
    },
    Kernel {
        series: "6.12",
        metapackages: &["linux-image-6.12-{arch}", "linux-image-{arch}"],
        note: "bookworm-security (LTS) or bookworm-backports",
        // Not `tsc=reliable`: 6.12 then marks sched_clock stable at boot, patching its
        // static key with int3 while the other vCPU runs it, and multi-threaded TCG panics
        // on the int3 (`Oops: int3` in `sched_clock_cpu` at 3.7 s, every boot).
        append_amd64: "",
        arch: Arch::Amd64,
    },
];

/// Suites the private apt state reads. Debian's archive keyring (debian-archive-keyring, on
/// every Debian host) holds the bullseye, bookworm and trixie keys, so `signed-by` only names
/// it explicitly: nothing is trusted without a signature.
const SOURCES: &[(&str, &str)] = &[
    ("http://deb.debian.org/debian", "bullseye"),
    ("http://deb.debian.org/debian-security", "bullseye-security"),
    ("http://deb.debian.org/debian", "bookworm"),
    ("http://deb.debian.org/debian-security", "bookworm-security"),
    ("http://deb.debian.org/debian", "bookworm-backports"),
];
const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// Host packages this command runs besides the guest's qemu (`arch.rs`): a static busybox for
/// the initramfs (and as the amd64 guest's init), kmod (depmod/modprobe for the guest's
/// modules), xz/zstd (compressed modules), e2fsprogs (the scratch disk).
pub const HOST_PACKAGES: &[&str] = &[
    "busybox-static",
    "kmod",
    "xz-utils",
    "zstd",
    "e2fsprogs",
    // The iscsi test's target and initiator (run in the guest only; their services are not
    // started here).
    "tgt",
    "open-iscsi",
    // The device_mapper test's dm-delay device.
    "dmsetup",
    // Checks that cross-compiled binaries are of the guest's architecture.
    "file",
];

/// Modules the initramfs loads to reach the root filesystem (with their dependencies).
const INITRAMFS_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];
/// Modules the guest script loads from the guest kernel's tree once the root is up.
const GUEST_MODULES: &[&str] = &["virtio_blk", "ext4", "loop", "fuse"];

/// The tests run by default: name of the integration test target, then libtest filters.
pub const DEFAULT_TESTS: &[&str] = &[
    "block_io",
    "big_node",
    "syscall",
    "futex",
    "postgres",
    "query_protocols:pg15_+pg18_",
    "pg_scan:pg15_+pg17_",
    "pg_churn",
    "longhorn_stack",
    "iscsi",
    "device_mapper",
    "platform",
];

const INIT_SH: &str = include_str!("integration/init.sh");

pub struct Options {
    pub kernels: Vec<Kernel>,
    pub tests: Vec<TestSpec>,
    pub test_timeout: Duration,
    pub memory_mb: u32,
    pub update_kernels: bool,
    /// Run the tests even when `pgio-daemon check` fails in the guest.
    pub run_if_check_fails: bool,
    /// Possible CPUs of the guest (`-smp 2,maxcpus=N`; arm64 has 2, no CPU hotplug).
    pub max_cpus: u32,
    /// More kernel command line (after the architecture's own).
    pub append: String,
    /// The guests' architecture (every kernel of `kernels` has it).
    pub arch: Arch,
}

/// A big node's possible CPUs: per-CPU maps cost their values once per possible CPU, and
/// under TCG the offline ones cost nothing else.
pub const DEFAULT_MAX_CPUS: u32 = 128;

/// `name[:filter+filter…]`: one test target of pgio-daemon, optionally only the tests whose
/// names contain one of the filters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestSpec {
    pub name: String,
    pub filters: Vec<String>,
}

impl std::str::FromStr for TestSpec {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let (name, filters) = match s.split_once(':') {
            Some((n, f)) => (n, f.split('+').filter(|f| !f.is_empty()).collect()),
            None => (s, Vec::new()),
        };
        let ok = |t: &str| {
            !t.is_empty()
                && t.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        ensure!(ok(name), "bad test name {name:?}");
        for f in &filters {
            ensure!(
                ok(f),
                "bad test filter {f:?} (letters, digits, _ and - only)"
            );
        }
        Ok(TestSpec {
            name: name.to_owned(),
            filters: filters.into_iter().map(str::to_owned).collect(),
        })
    }
}

impl std::fmt::Display for TestSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.filters.is_empty() {
            write!(f, "{}", self.name)
        } else {
            write!(f, "{}:{}", self.name, self.filters.join("+"))
        }
    }
}

/// What `cargo xtask test` runs: Debian 6.1 (the fallback path), these tests, the defaults.
pub fn ci_options(tests: &[&str]) -> Result<Options> {
    Ok(Options {
        kernels: kernel_by_series("6.1", Arch::Amd64)?,
        tests: tests
            .iter()
            .map(|t| t.parse())
            .collect::<Result<Vec<_>>>()?,
        test_timeout: Duration::from_secs(1200),
        memory_mb: 4096,
        update_kernels: false,
        run_if_check_fails: false,
        max_cpus: DEFAULT_MAX_CPUS,
        append: String::new(),
        arch: Arch::Amd64,
    })
}

/// The kernels of `s` (`6.1`, `5.10,6.12`, `all`) for guests of `arch`.
pub fn kernel_by_series(s: &str, arch: Arch) -> Result<Vec<Kernel>> {
    let with_arch = |k: &Kernel| Kernel { arch, ..*k };
    if s == "all" {
        return Ok(KERNELS.iter().map(with_arch).collect());
    }
    s.split(',')
        .map(|one| {
            KERNELS
                .iter()
                .find(|k| k.series == one)
                .map(with_arch)
                .with_context(|| {
                    let known: Vec<_> = KERNELS.iter().map(|k| k.series).collect();
                    format!("unknown kernel {one:?} (known: {}, all)", known.join(", "))
                })
        })
        .collect()
}

/// Everything the host prepares once for all kernels.
struct HostBuild {
    daemon: PathBuf,
    load: PathBuf,
    longhorn_dir: PathBuf,
    pg_dist: PathBuf,
    /// (spec, executable)
    tests: Vec<(TestSpec, PathBuf)>,
}

pub fn integration(root: &Path, skip_setup: bool, opts: &Options) -> Result<()> {
    ensure!(
        is_root(),
        "cargo xtask integration boots kernels whose tests load eBPF as root in the guest, and \
         reads the whole host root over 9p: run it as root"
    );
    let started = Instant::now();
    ensure!(
        opts.kernels.iter().all(|k| k.arch == opts.arch),
        "every kernel must be of the guests' architecture {}",
        opts.arch.name()
    );
    let guest = arch::guest(opts.arch);
    if !skip_setup {
        crate::apt::ensure(HOST_PACKAGES)?;
        crate::apt::ensure(&[guest.qemu_package])?;
    }
    if !skip_setup {
        crate::build::setup()?;
    }
    cross::ensure(opts.arch, skip_setup)?;
    let host = host_build(root, opts)?;
    let base = target_dir(root).join("integration");
    let mut reports = Vec::new();
    for kernel in &opts.kernels {
        let k_started = Instant::now();
        let report = match run_kernel(root, &base, kernel, &host, opts) {
            Ok(r) => r,
            Err(e) => KernelReport::failed(kernel, format!("{e:#}")),
        };
        let report = KernelReport {
            total: k_started.elapsed(),
            ..report
        };
        eprintln!("{}", report.render());
        reports.push(report);
    }
    let text = render_all(&reports);
    let path = base.join(match opts.arch {
        Arch::Amd64 => "report.md".to_owned(),
        a => format!("report-{}.md", a.name()),
    });
    fs::write(&path, &text).with_context(|| format!("writing {}", path.display()))?;
    println!("{text}");
    step(format!(
        "integration: report in {} ({} total)",
        path.display(),
        fmt_duration(started.elapsed())
    ));
    let failed: usize = reports.iter().map(KernelReport::failures).sum();
    if failed == 0 && is_whole_matrix(opts) {
        let path = root.join("KERNELS.md");
        fs::write(&path, kernels_md(root, &text, started.elapsed()))
            .with_context(|| format!("writing {}", path.display()))?;
        step(format!(
            "integration: the whole matrix passed: {}",
            path.display()
        ));
    }
    ensure!(failed == 0, "{failed} failure(s)");
    Ok(())
}

/// Every kernel with the default tests: the run KERNELS.md reports.
fn is_whole_matrix(opts: &Options) -> bool {
    let kernels: Vec<&str> = opts.kernels.iter().map(|k| k.series).collect();
    let all: Vec<&str> = KERNELS.iter().map(|k| k.series).collect();
    let tests: Vec<String> = opts.tests.iter().map(TestSpec::to_string).collect();
    opts.arch == Arch::Amd64 && kernels == all && tests == DEFAULT_TESTS
}

/// KERNELS.md: the report of a whole-matrix run that passed, with where it ran.
fn kernels_md(root: &Path, report: &str, took: Duration) -> String {
    let host = output(Command::new("uname").arg("-r"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let commit =
        output(
            Command::new("git")
                .arg("-C")
                .arg(root)
                .args(["rev-parse", "--short", "HEAD"]),
        )
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    format!(
        "# pgio on Debian's kernels\n\n\
         Written by `cargo xtask integration --kernel all` (this file is its output, only when \
         every test passed on every kernel): tree {commit}, host kernel {host}, 2 vCPUs of TCG \
         per guest, {} for the whole matrix. Each test's figures are what it printed; the \
         setup and the minimum kernel per feature are in [docs/testing.md](docs/testing.md#kernels).\n\n{}",
        fmt_duration(took),
        report.trim_start_matches("## cargo xtask integration\n\n")
    )
}

/// The release binaries for the guests' architecture (`--target` when it is not the host's).
fn host_build(root: &Path, opts: &Options) -> Result<HostBuild> {
    let target = target_dir(root);
    let arch = opts.arch;
    let built = crate::test_build::build(root, arch)?;
    let tests = opts
        .tests
        .iter()
        .map(|t| {
            built
                .tests
                .get(&t.name)
                .map(|p| (t.clone(), p.clone()))
                .with_context(|| format!("cargo built no test executable named {}", t.name))
        })
        .collect::<Result<Vec<_>>>()?;
    let (daemon, load) = (built.bin("pgio-daemon")?, built.bin("pgio-load")?);
    if !arch.is_host() {
        for exe in tests.iter().map(|(_, e)| e).chain([&daemon, &load]) {
            cross::check_file(exe, arch)?;
        }
    }

    step("building the Longhorn stand-in (Go)");
    let longhorn_dir = if arch.is_host() {
        pgio_testkit::longhorn::standin_bin_dir()?
    } else {
        cross::build_longhorn_standin(root, arch)?
    };
    // The guest has no network: download the PostgreSQL builds the tests ask for here.
    let pg_dist = target.join("pg-dist");
    let majors = pg_majors(&opts.tests);
    // The builds the testkit downloads are the host's architecture; arm64 guests have
    // Debian's PostgreSQL 15 only.
    ensure!(
        arch.is_host() || majors.is_empty(),
        "PostgreSQL {majors:?} for {} guests: only Debian's 15 is in their root filesystem",
        arch.name()
    );
    // SAFETY: single-threaded here; the testkit reads it on this thread only.
    unsafe { std::env::set_var(pgio_testkit::pgdist::PG_DIST_ENV, &pg_dist) };
    for major in majors {
        step(format!("PostgreSQL {major} for the guest"));
        pgio_testkit::pg_bin_dir(major)?;
    }
    Ok(HostBuild {
        daemon,
        load,
        longhorn_dir,
        pg_dist,
        tests,
    })
}

/// Major versions beyond Debian's 15 the selected tests start: `pg_scan:pg17_` needs 17 only,
/// an unfiltered PostgreSQL test every version the testkit has.
fn pg_majors(tests: &[TestSpec]) -> Vec<u32> {
    const MULTI: &[&str] = &[
        "pg_scan",
        "pg_titles",
        "pg_clusters",
        "query",
        "query_protocols",
    ];
    let mut out = Vec::new();
    for t in tests.iter().filter(|t| MULTI.contains(&t.name.as_str())) {
        for major in pgio_testkit::pgdist::PG_MAJORS
            .into_iter()
            .filter(|m| *m != 15)
        {
            let tag = format!("pg{major}");
            if t.filters.is_empty() || t.filters.iter().any(|f| f.starts_with(&tag)) {
                out.push(major);
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The private apt state: its own sources.list, lists and archive cache; the host's apt
/// configuration (`apt.conf.d`, sources) is not read.
struct Apt {
    dir: PathBuf,
}

impl Apt {
    fn new(base: &Path) -> Result<Apt> {
        let dir = base.join("apt");
        for d in [
            "etc/apt.conf.d",
            "etc/sources.list.d",
            "state/lists/partial",
        ] {
            fs::create_dir_all(dir.join(d))
                .with_context(|| format!("creating {}", dir.join(d).display()))?;
        }
        fs::create_dir_all(dir.join("cache/archives/partial"))?;
        let mut list = String::new();
        for (uri, suite) in SOURCES {
            writeln!(list, "deb [signed-by={KEYRING}] {uri} {suite} main")?;
        }
        fs::write(dir.join("etc/sources.list"), list)?;
        Ok(Apt { dir })
    }

    fn cmd(&self, program: &str) -> Command {
        let d = |p: &str| self.dir.join(p).display().to_string();
        let mut c = Command::new(program);
        for (k, v) in [
            ("Dir::Etc::SourceList", d("etc/sources.list")),
            ("Dir::Etc::SourceParts", d("etc/sources.list.d")),
            ("Dir::Etc::Parts", d("etc/apt.conf.d")),
            ("Dir::State", d("state")),
            ("Dir::Cache", d("cache")),
            // apt-get download writes into the cwd as root: the _apt sandbox user may not be
            // able to enter target/.
            ("APT::Sandbox::User", "root".to_owned()),
            // Only Packages indices: no translations, no DEP-11 (the host's apt.conf.d asks
            // for those, and is not read here anyway).
            ("Acquire::Languages", "none".to_owned()),
        ] {
            c.arg("-o").arg(format!("{k}={v}"));
        }
        // Every guest architecture's indices, whatever this run boots: one state serves all.
        c.args(["-o", "APT::Architectures::="]);
        for a in Arch::ALL {
            c.arg("-o")
                .arg(format!("APT::Architectures::={}", a.name()));
        }
        c.env("DEBIAN_FRONTEND", "noninteractive");
        c
    }

    fn update(&self) -> Result<()> {
        step("apt-get update (private state, target/integration/apt)");
        output(self.cmd("apt-get").args(["-q", "update"])).map(|_| ())
    }

    /// The image package of `kernel`'s newest version in the configured suites.
    fn resolve(&self, kernel: &Kernel) -> Result<(String, String)> {
        let mut best: Option<(String, String)> = None;
        for meta in kernel.metapackages() {
            let meta = format!("{meta}:{}", kernel.arch.name());
            let Ok(text) = output(self.cmd("apt-cache").args(["show", &meta])) else {
                continue;
            };
            for stanza in text.split("\n\n") {
                let field = |name: &str| {
                    stanza.lines().find_map(|l| {
                        l.strip_prefix(name)
                            .and_then(|r| r.strip_prefix(':'))
                            .map(str::trim)
                    })
                };
                let (Some(version), Some(depends)) = (field("Version"), field("Depends")) else {
                    continue;
                };
                if !version.starts_with(&format!("{}.", kernel.series)) {
                    continue;
                }
                // `linux-image-6.1.0-56-amd64 (= 6.1.192-2)`
                let Some(pkg) = depends
                    .split(',')
                    .next()
                    .and_then(|d| d.split_whitespace().next())
                else {
                    continue;
                };
                let newer = match &best {
                    None => true,
                    Some((v, _)) => version_gt(version, v)?,
                };
                if newer {
                    best = Some((version.to_owned(), pkg.to_owned()));
                }
            }
        }
        best.with_context(|| {
            format!(
                "no linux-image package of {} for {} in {}",
                kernel.series,
                kernel.arch.name(),
                SOURCES.iter().map(|s| s.1).collect::<Vec<_>>().join(", ")
            )
        })
    }
}

/// `dpkg --compare-versions a gt b`.
fn version_gt(a: &str, b: &str) -> Result<bool> {
    let status = Command::new("dpkg")
        .args(["--compare-versions", a, "gt", b])
        .status()
        .context("running dpkg --compare-versions")?;
    Ok(status.success())
}

/// An unpacked kernel: `root/boot/vmlinuz-<kver>`, `root/lib/modules/<kver>` (depmod run).
struct KernelTree {
    package: String,
    kver: String,
    root: PathBuf,
}

impl KernelTree {
    fn vmlinuz(&self) -> PathBuf {
        self.root
            .join("boot")
            .join(format!("vmlinuz-{}", self.kver))
    }
    fn moddir(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.kver)
    }
}

/// The cached tree of `kernel`, fetched and unpacked if missing (or `update`). The stamp file
/// (package name) is written last: a half-unpacked tree is redone.
fn kernel_tree(
    base: &Path,
    kernel: &Kernel,
    update: bool,
    apt: &mut Option<Apt>,
) -> Result<KernelTree> {
    let dir = base.join("kernels").join(kernel.label());
    let stamp = dir.join("package");
    let root = dir.join("root");
    if !update
        && let Ok(package) = fs::read_to_string(&stamp)
        && let Some(kver) = single_kver(&root)
    {
        step(format!(
            "kernel {}: cached {}",
            kernel.label(),
            package.trim()
        ));
        return Ok(KernelTree {
            package: package.trim().to_owned(),
            kver,
            root,
        });
    }
    let apt = apt_state(base, apt)?;
    let (version, package) = apt.resolve(kernel)?;
    step(format!("kernel {}: {package} {version}", kernel.label()));
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let debs = dir.join("deb");
    fs::create_dir_all(&debs)?;
    run(apt
        .cmd("apt-get")
        .args([
            "-q",
            "download",
            &format!("{package}:{}", kernel.arch.name()),
        ])
        .current_dir(&debs))?;
    let deb = fs::read_dir(&debs)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download left no .deb in {}", debs.display()))?;
    step(format!("dpkg-deb -x {}", deb.display()));
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
    let kver = single_kver(&root)
        .with_context(|| format!("{package}: not one directory under lib/modules"))?;
    run(Command::new("depmod").arg("-b").arg(&root).arg(&kver))?;
    // The .deb is not needed once unpacked.
    fs::remove_dir_all(&debs)?;
    fs::write(&stamp, &package)?;
    Ok(KernelTree {
        package,
        kver,
        root,
    })
}

/// The private apt state, its indices updated once per run when first needed.
fn apt_state<'a>(base: &Path, apt: &'a mut Option<Apt>) -> Result<&'a Apt> {
    Ok(match apt {
        Some(a) => a,
        None => {
            let a = Apt::new(base)?;
            a.update()?;
            apt.insert(a)
        }
    })
}

fn single_kver(root: &Path) -> Option<String> {
    let mut names = fs::read_dir(root.join("lib/modules"))
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok());
    let first = names.next()?;
    names.next().is_none().then_some(first)
}

/// The busybox initramfs: static busybox, `init.sh`, the root filesystem's modules
/// (decompressed: busybox insmod takes plain .ko), `/config`. `guest_root`: the root
/// filesystem built for a foreign guest (its busybox goes in, and the workspace is shared
/// separately); `None`: the host's.
fn initramfs(
    tree: &KernelTree,
    guest_root: Option<&Path>,
    workspace: &Path,
    guest_script: &Path,
    out: &Path,
) -> Result<()> {
    let stage = pgio_testkit::temp_dir().context("temp dir for the initramfs")?;
    let s = stage.path();
    fs::create_dir_all(s.join("bin"))?;
    fs::create_dir_all(s.join("modules"))?;
    // The host's runs cpio here; the guest's runs in the guest.
    let busybox = busybox()?;
    let guest_busybox = match guest_root {
        Some(r) => r.join("bin/busybox"),
        None => busybox.clone(),
    };
    fs::copy(&guest_busybox, s.join("bin/busybox"))
        .with_context(|| format!("copying {}", guest_busybox.display()))?;
    let mut order: Vec<String> = Vec::new();
    for m in INITRAMFS_MODULES {
        let deps = output(
            Command::new("modprobe")
                .arg("-d")
                .arg(&tree.root)
                .arg("-S")
                .arg(&tree.kver)
                .args(["--show-depends", m]),
        )?;
        for line in deps.lines() {
            // `insmod /path/x.ko[.xz] [params]`; `builtin x` needs nothing.
            let mut w = line.split_whitespace();
            if w.next() != Some("insmod") {
                continue;
            }
            let Some(path) = w.next().map(PathBuf::from) else {
                continue;
            };
            let file = path
                .file_name()
                .and_then(|f| f.to_str())
                .with_context(|| format!("module path {}", path.display()))?;
            let (plain, decompress) = match file.rsplit_once('.') {
                Some((p, "xz")) => (p.to_owned(), Some("xz")),
                Some((p, "zst")) => (p.to_owned(), Some("zstd")),
                _ => (file.to_owned(), None),
            };
            if order.contains(&plain) {
                continue;
            }
            let dest = s.join("modules").join(&plain);
            match decompress {
                Some(tool) => {
                    let f = fs::File::create(&dest)?;
                    run(Command::new(tool)
                        .args(["-dc"])
                        .arg(&path)
                        .stdout(Stdio::from(f)))?;
                }
                None => {
                    fs::copy(&path, &dest)?;
                }
            }
            order.push(plain);
        }
    }
    fs::write(s.join("modules/order"), order.join("\n") + "\n")?;
    write_exec(&s.join("init"), INIT_SH)?;
    fs::write(
        s.join("config"),
        shell_vars(&[
            ("KVER", tree.kver.clone()),
            ("MODDIR", tree.moddir().display().to_string()),
            ("GUEST_SCRIPT", guest_script.display().to_string()),
            // Its path in the guest's root, where switch_root runs it as init.
            (
                "BUSYBOX",
                match guest_root {
                    Some(_) => "/bin/busybox".to_owned(),
                    None => busybox.display().to_string(),
                },
            ),
            // Where the `workspace` share goes (empty: the host root already has it).
            (
                "WORKSPACE_SHARE",
                match guest_root {
                    Some(_) => workspace.display().to_string(),
                    None => String::new(),
                },
            ),
        ])?,
    )?;
    // newc archive of the staged tree, paths relative to it.
    let mut find = Command::new("find");
    find.arg(".").current_dir(s).stdout(Stdio::piped());
    let mut find = find.spawn().context("running find")?;
    let list = find.stdout.take().context("find's stdout")?;
    let out_file = fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    run(Command::new(&busybox)
        .args(["cpio", "-o", "-H", "newc"])
        .current_dir(s)
        .stdin(Stdio::from(list))
        .stdout(Stdio::from(out_file))
        .stderr(Stdio::null()))?;
    ensure!(find.wait()?.success(), "find failed");
    Ok(())
}

/// The static busybox (Debian's busybox-static): it runs before any library is reachable.
fn busybox() -> Result<PathBuf> {
    let p = PathBuf::from("/bin/busybox");
    let file = output(Command::new("ldd").arg(&p)).unwrap_or_default();
    ensure!(
        p.is_file(),
        "{} missing: apt-get install busybox-static",
        p.display()
    );
    // ldd fails on a static binary ("not a dynamic executable"): that is what we want.
    ensure!(
        !file.contains("libc.so"),
        "{} is dynamically linked: apt-get install busybox-static",
        p.display()
    );
    Ok(p)
}

fn write_exec(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::write(path, text)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// `NAME='value'` lines a POSIX shell can source.
fn shell_vars(vars: &[(&str, String)]) -> Result<String> {
    let mut out = String::new();
    for (k, v) in vars {
        let q = shlex::try_quote(v).with_context(|| format!("{k}: cannot quote {v:?}"))?;
        writeln!(out, "{k}={q}")?;
    }
    Ok(out)
}

/// Kills and reaps qemu when dropped (a failure or panic on the host side).
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// Deletes a disk image when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

fn run_kernel(
    root: &Path,
    base: &Path,
    kernel: &Kernel,
    host: &HostBuild,
    opts: &Options,
) -> Result<KernelReport> {
    let mut apt = None;
    let guest = kernel.guest();
    let tree = kernel_tree(base, kernel, opts.update_kernels, &mut apt)?;
    let guest_root = if guest.host_root {
        None
    } else {
        Some(rootfs::ensure(
            base,
            kernel.arch,
            opts.update_kernels,
            &mut apt,
        )?)
    };
    let run_dir = base.join("runs").join(kernel.label());
    if run_dir.exists() {
        fs::remove_dir_all(&run_dir).with_context(|| format!("removing {}", run_dir.display()))?;
    }
    let results = run_dir.join("results");
    fs::create_dir_all(&results)?;
    let guest_script = root.join("xtask/src/integration/guest.sh");
    let initrd = run_dir.join("initramfs.cpio");
    initramfs(&tree, guest_root.as_deref(), root, &guest_script, &initrd)?;

    // The scratch disk: /tmp in the guest, ext4 made here (no lazy init IO in the guest).
    let scratch = Scratch(run_dir.join("scratch.img"));
    fs::File::create(&scratch.0)?.set_len(16 << 30)?;
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"])
        .arg(&scratch.0)
        .stdout(Stdio::null()))?;
    // A second, blank disk (`/dev/vdb`) nothing else uses: the disk below the device_mapper
    // test's dm-delay device, as a virtio disk is below a dm device on a real node.
    let spare = Scratch(run_dir.join("spare.img"));
    fs::File::create(&spare.0)?.set_len(1 << 30)?;

    // arm's virt machine has no CPU hotplug: its possible CPUs are the online ones.
    let max_cpus = if guest.hotplug_cpus {
        opts.max_cpus.max(2)
    } else {
        2
    };
    let tests: Vec<String> = host
        .tests
        .iter()
        .map(|(t, exe)| {
            let mut line = vec![t.name.clone(), exe.display().to_string()];
            line.extend(t.filters.iter().cloned());
            line.join(" ")
        })
        .collect();
    let env = shell_vars(&[
        ("GUEST_MODULES", GUEST_MODULES.join(" ")),
        // Kept visible when it lives under /tmp, which the scratch disk covers in the guest.
        ("WORKSPACE", root.display().to_string()),
        ("PGIO_DAEMON", host.daemon.display().to_string()),
        ("PGIO_LOAD_BIN", host.load.display().to_string()),
        (
            "PGIO_LONGHORN_BIN_DIR",
            host.longhorn_dir.display().to_string(),
        ),
        ("PGIO_PG_DIST", host.pg_dist.display().to_string()),
        ("PGIO_TEST_SPARE_DISK", "/dev/vdb".to_owned()),
        // What the guest's kernel must report (big_node fails on fewer).
        ("PGIO_TEST_POSSIBLE_CPUS", max_cpus.to_string()),
        ("TEST_TIMEOUT", opts.test_timeout.as_secs().to_string()),
        (
            "RUN_IF_CHECK_FAILS",
            u8::from(opts.run_if_check_fails).to_string(),
        ),
        ("TESTS", tests.join("\n")),
    ])?;
    fs::write(results.join("run.env"), env)?;

    let console = run_dir.join("console.log");
    let mut qemu = Command::new(guest.qemu);
    // The guest's root: the host's, or the one built for its architecture plus the workspace
    // (the binaries, the guest script, the kernel's modules) at the same path.
    let mut shares = vec![(
        "hostroot",
        guest_root.clone().unwrap_or_else(|| PathBuf::from("/")),
    )];
    if guest_root.is_some() {
        shares.push(("workspace", root.to_path_buf()));
    }
    qemu.args(guest.machine)
        .arg("-smp")
        .arg(format!("2,maxcpus={max_cpus}"))
        .args(["-m", &format!("{}M", opts.memory_mb)])
        .args(["-display", "none", "-monitor", "none", "-no-reboot"])
        .arg("-kernel")
        .arg(tree.vmlinuz())
        .arg("-initrd")
        .arg(&initrd)
        // panic=-1 + -no-reboot: a panic ends qemu at once.
        .arg("-append")
        .arg(
            format!(
                "console={} panic=-1 {} {}",
                guest.console,
                kernel.append(),
                opts.append
            )
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
        );
    for (tag, path) in &shares {
        qemu.arg("-fsdev")
            .arg(format!(
                "local,id={tag},path={},readonly=on,security_model=passthrough,multidevs=remap",
                path.display()
            ))
            .arg("-device")
            .arg(format!("virtio-9p-pci,fsdev={tag},mount_tag={tag}"));
    }
    qemu.arg("-fsdev")
        .arg(format!(
            "local,id=results,path={},security_model=none",
            results.display()
        ))
        .args(["-device", "virtio-9p-pci,fsdev=results,mount_tag=results"])
        .arg("-drive")
        .arg(format!(
            "file={},if=virtio,format=raw,cache=none,aio=threads",
            scratch.0.display()
        ))
        .arg("-drive")
        .arg(format!(
            "file={},if=virtio,format=raw,cache=none,aio=threads",
            spare.0.display()
        ))
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .stdin(Stdio::null());
    step(format!("kernel {}: {}", kernel.label(), describe(&qemu)));
    let started = Instant::now();
    let mut child = Qemu(
        qemu.spawn()
            .with_context(|| format!("starting {}", guest.qemu))?,
    );
    // Boot and shutdown take well under 2 minutes even under TCG.
    let limit = opts.test_timeout * (host.tests.len() as u32 + 1) + Duration::from_secs(120);
    let mut shown = 0;
    let status = loop {
        if let Some(s) = child.0.try_wait()? {
            break Some(s);
        }
        if started.elapsed() > limit {
            break None;
        }
        shown = show_progress(&results, kernel, shown);
        std::thread::sleep(Duration::from_secs(2));
    };
    drop(child);
    drop(scratch);
    drop(spare);
    let wall = started.elapsed();
    let mut report = collect(kernel, &tree, &results, &console, wall)?;
    match status {
        None => report
            .problems
            .push(format!("qemu killed after {}", fmt_duration(limit))),
        Some(s) if !s.success() => report.problems.push(format!("qemu exited {s}")),
        Some(_) => {}
    }
    Ok(report)
}

/// Prints summary lines the guest wrote since the last call; returns how many are shown.
fn show_progress(results: &Path, kernel: &Kernel, shown: usize) -> usize {
    let Ok(text) = fs::read_to_string(results.join("summary")) else {
        return shown;
    };
    let lines: Vec<&str> = text.lines().collect();
    for l in lines.iter().skip(shown) {
        let mut w = l.split_whitespace();
        if let (Some(name), Some(rc)) = (w.next(), w.next()) {
            let verdict = match rc {
                "0" => "pass",
                "skipped" => "not run (check failed)",
                _ => "FAIL",
            };
            step(format!("kernel {}: {name}: {verdict}", kernel.label()));
        }
    }
    lines.len()
}

pub struct TestResult {
    pub name: String,
    pub passed: bool,
    pub exit: String,
    pub duration: Duration,
    /// The test's own printed figures (or its panic message when it failed).
    pub figures: Vec<String>,
    pub counts: String,
}

pub struct KernelReport {
    series: String,
    note: &'static str,
    package: String,
    boot: Option<Duration>,
    total: Duration,
    tests: Vec<TestResult>,
    check: Vec<String>,
    problems: Vec<String>,
}

impl KernelReport {
    fn failed(kernel: &Kernel, why: String) -> KernelReport {
        KernelReport {
            series: kernel.label(),
            note: kernel.note,
            package: String::new(),
            boot: None,
            total: Duration::ZERO,
            tests: Vec::new(),
            check: Vec::new(),
            problems: vec![why],
        }
    }

    fn failures(&self) -> usize {
        self.tests.iter().filter(|t| !t.passed).count() + self.problems.len()
    }

    fn render(&self) -> String {
        let mut s = String::new();
        let boot = self
            .boot
            .map_or_else(|| "-".to_owned(), |b| format!("{:.1}s", b.as_secs_f64()));
        let _ = writeln!(
            s,
            "### Kernel {} ({}; {}): boot {boot}, total {}\n",
            self.series,
            self.package,
            self.note,
            fmt_duration(self.total)
        );
        if !self.tests.is_empty() {
            s.push_str("| test | result | time | libtest | figures |\n|---|---|---|---|---|\n");
            for t in &self.tests {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} |",
                    t.name,
                    match (t.passed, t.exit.as_str()) {
                        (true, _) => "pass".to_owned(),
                        (false, "skipped") => "**not run**".to_owned(),
                        (false, exit) => format!("**FAIL** (exit {exit})"),
                    },
                    fmt_duration(t.duration),
                    t.counts,
                    t.figures.join("<br>").replace('|', "\\|")
                );
            }
            s.push('\n');
        }
        for c in &self.check {
            let _ = writeln!(s, "- check: {c}");
        }
        for p in &self.problems {
            let _ = writeln!(s, "- **problem**: {p}");
        }
        s
    }
}

fn render_all(reports: &[KernelReport]) -> String {
    let mut s = String::from("## cargo xtask integration\n\n");
    for r in reports {
        s.push_str(&r.render());
        s.push('\n');
    }
    s
}

fn collect(
    kernel: &Kernel,
    tree: &KernelTree,
    results: &Path,
    console: &Path,
    wall: Duration,
) -> Result<KernelReport> {
    let read = |name: &str| fs::read_to_string(results.join(name)).ok();
    let boot = read("booted")
        .and_then(|b| b.trim().parse::<f64>().ok())
        .map(Duration::from_secs_f64);
    let mut problems = Vec::new();
    if read("finished").is_none() {
        let tail: Vec<String> = fs::read_to_string(console)
            .unwrap_or_default()
            .lines()
            .rev()
            .take(15)
            .map(str::to_owned)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        problems.push(format!(
            "the guest did not finish ({}); console tail:\n```\n{}\n```",
            fmt_duration(wall),
            tail.join("\n")
        ));
    }
    // `pgio-daemon check`'s lines that are not ok: what this kernel lacks.
    let check: Vec<String> = read("check.log")
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim_start().starts_with("ok"))
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect();
    let mut tests = Vec::new();
    for line in read("summary").unwrap_or_default().lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        let [name, rc, start, end] = w[..] else {
            continue;
        };
        let secs = |s: &str| s.parse::<f64>().unwrap_or(0.0);
        let log = read(&format!("{name}.log")).unwrap_or_default();
        let (figures, counts) = figures(&log);
        tests.push(TestResult {
            name: name.to_owned(),
            passed: rc == "0",
            exit: rc.to_owned(),
            duration: Duration::from_secs_f64((secs(end) - secs(start)).max(0.0)),
            figures: match rc {
                "124" => vec![format!("timed out; {}", figures.join("; "))],
                "skipped" => vec!["not run: `pgio-daemon check` failed (below)".to_owned()],
                _ => figures,
            },
            counts,
        });
    }
    Ok(KernelReport {
        series: kernel.label(),
        note: kernel.note,
        package: tree.package.clone(),
        boot,
        total: wall,
        tests,
        check,
        problems,
    })
}

/// A test log's own lines (its `eprintln!` figures; panic messages), without libtest's
/// framing, and libtest's `N passed; M failed` counts.
fn figures(log: &str) -> (Vec<String>, String) {
    let mut out = Vec::new();
    let mut counts = String::new();
    let mut lines = log.lines().peekable();
    while let Some(l) = lines.next() {
        // With --nocapture a test's first printed line follows `test name ... ` on its line.
        let t = match l.split_once(" ... ") {
            Some((head, rest)) if head.starts_with("test ") => rest.trim(),
            _ => l.trim(),
        };
        if matches!(t, "ok" | "FAILED" | "ignored") {
            continue;
        }
        if let Some(rest) = t.strip_prefix("test result: ") {
            // `ok. 2 passed; 0 failed; 0 ignored; 0 measured; 3 filtered out; finished in …`
            counts = rest
                .split(';')
                .take(2)
                .map(str::trim)
                .collect::<Vec<_>>()
                .join(", ");
            continue;
        }
        if t.contains("panicked at") {
            if let Some(msg) = lines.next() {
                out.push(format!("panic: {}", msg.trim()));
            }
            continue;
        }
        let framing = t.is_empty()
            || t.starts_with("running ")
            || t.starts_with("successes:")
            || t.starts_with("failures:")
            || t.starts_with("---- ")
            || t.starts_with("note: ")
            || t.starts_with("stack backtrace:")
            || t.starts_with("at ")
            || t.chars().next().is_some_and(|c| c.is_ascii_digit())
            || t.starts_with("pgio-testkit:");
        if framing {
            continue;
        }
        let short: String = t.chars().take(220).collect();
        if !out.contains(&short) {
            out.push(short);
        }
    }
    out.truncate(8);
    (out, counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_specs_parse() {
        let t: TestSpec = "pg_scan:pg15_+pg17_".parse().unwrap();
        assert_eq!(t.name, "pg_scan");
        assert_eq!(t.filters, ["pg15_", "pg17_"]);
        assert_eq!(t.to_string(), "pg_scan:pg15_+pg17_");
        assert!("block_io".parse::<TestSpec>().unwrap().filters.is_empty());
        assert!("a b".parse::<TestSpec>().is_err());
        assert!("x:$(rm)".parse::<TestSpec>().is_err());
    }

    #[test]
    fn pg_majors_from_filters() {
        let specs: Vec<TestSpec> = DEFAULT_TESTS.iter().map(|s| s.parse().unwrap()).collect();
        assert_eq!(pg_majors(&specs), [17, 18]);
        assert_eq!(pg_majors(&["pg_scan".parse().unwrap()]), [16, 17, 18]);
    }

    #[test]
    fn only_the_whole_matrix_writes_kernels_md() {
        let mut opts = ci_options(DEFAULT_TESTS).unwrap();
        assert!(!is_whole_matrix(&opts), "6.1 alone");
        opts.kernels = kernel_by_series("all", Arch::Amd64).unwrap();
        assert!(is_whole_matrix(&opts));
        opts.tests.pop();
        assert!(!is_whole_matrix(&opts), "fewer tests");
    }

    #[test]
    fn kernels_by_name() {
        assert_eq!(
            kernel_by_series("all", Arch::Amd64).unwrap().len(),
            KERNELS.len()
        );
        assert_eq!(
            kernel_by_series("6.1", Arch::Amd64).unwrap()[0].series,
            "6.1"
        );
        assert!(kernel_by_series("4.19", Arch::Amd64).is_err());
    }

    #[test]
    fn figures_skip_framing() {
        let log = "\nrunning 2 tests\ntest b ... pid 7: pread64 5\nok\ntest a ... ok\n\
                   diskstats reads 20000, pgio reads 20000\n\
                   test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 9.1s\n";
        let (f, c) = figures(log);
        assert_eq!(
            f,
            [
                "pid 7: pread64 5",
                "diskstats reads 20000, pgio reads 20000"
            ]
        );
        assert_eq!(c, "ok. 1 passed, 0 failed");
    }
}
