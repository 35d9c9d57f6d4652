//! A throwaway PostgreSQL cluster run as the `postgres` OS user, reachable only through a
//! Unix socket in a private directory. Drop always stops the server. Works with any major
//! `pgdist::pg_bin_dir` provides (15 to 18).

use std::ffi::{CString, OsStr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

use crate::cmd;
use crate::process::{pid_alive, processes_with_parent};

/// Server binaries of Debian's postgresql-15 package.
pub const PG15_BIN_DIR: &str = "/usr/lib/postgresql/15/bin";

/// How to create a cluster. `settings` are appended to postgresql.conf verbatim as
/// `name = value` (quote string values yourself, e.g. `("log_min_messages", "'debug1'")`).
#[derive(Debug, Clone)]
pub struct PgOptions {
    pub bin_dir: PathBuf,
    pub data_dir: PathBuf,
    pub port: u16,
    /// e.g. "128MB" (PostgreSQL's default) or "16MB" for a small cache that forces reads.
    pub shared_buffers: String,
    pub settings: Vec<(String, String)>,
    /// OS user owning the data directory and running the server.
    pub os_user: String,
}

impl PgOptions {
    pub fn new(bin_dir: impl Into<PathBuf>, data_dir: impl Into<PathBuf>, port: u16) -> Self {
        PgOptions {
            bin_dir: bin_dir.into(),
            data_dir: data_dir.into(),
            port,
            shared_buffers: "128MB".into(),
            settings: Vec::new(),
            os_user: "postgres".into(),
        }
    }

    pub fn shared_buffers(mut self, value: &str) -> Self {
        self.shared_buffers = value.into();
        self
    }

    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }
}

/// An initdb'ed cluster. The data directory lives where the test puts it (e.g. on an
/// `Ext4Mount`); socket and server log live in a private temp dir owned by the OS user.
/// Drop stops a running server: `pg_ctl -m fast`, then `-m immediate`, then SIGKILL to
/// the postmaster PID from postmaster.pid.
#[derive(Debug)]
pub struct PgCluster {
    opts: PgOptions,
    uid: u32,
    gid: u32,
    run_dir: tempfile::TempDir,
}

impl PgCluster {
    /// `init_with(PgOptions::new(bin_dir, data_dir, port))`.
    pub fn init(bin_dir: &Path, data_dir: &Path, port: u16) -> Result<Self> {
        Self::init_with(PgOptions::new(bin_dir, data_dir, port))
    }

    /// Creates `data_dir` (owned by the OS user, mode 0700), runs initdb as that user
    /// (trust auth, UTF8, C locale) and writes the settings: `listen_addresses = ''`,
    /// the socket directory, the port and `shared_buffers`, then `opts.settings`.
    pub fn init_with(opts: PgOptions) -> Result<Self> {
        let (uid, gid) = user_ids(&opts.os_user)?;
        check_traversable(&opts.data_dir, uid)?;
        std::fs::create_dir_all(&opts.data_dir)
            .with_context(|| format!("creating {}", opts.data_dir.display()))?;
        std::os::unix::fs::chown(&opts.data_dir, Some(uid), Some(gid))
            .with_context(|| format!("chown {}", opts.data_dir.display()))?;
        std::fs::set_permissions(&opts.data_dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("chmod {}", opts.data_dir.display()))?;

        let run_dir = crate::temp_dir()?;
        std::os::unix::fs::chown(run_dir.path(), Some(uid), Some(gid))
            .with_context(|| format!("chown {}", run_dir.path().display()))?;
        let cluster = PgCluster {
            opts,
            uid,
            gid,
            run_dir,
        };

        cmd::run(
            cluster
                .as_os_user("initdb")
                .arg("-D")
                .arg(&cluster.opts.data_dir)
                .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C"]),
        )?;

        let mut conf = String::from("\n# pgio-testkit\n");
        conf += "listen_addresses = ''\n";
        conf += &format!(
            "unix_socket_directories = '{}'\n",
            escape_conf(&cluster.socket_dir().to_string_lossy())
        );
        conf += &format!("port = {}\n", cluster.opts.port);
        conf += &format!(
            "shared_buffers = '{}'\n",
            escape_conf(&cluster.opts.shared_buffers)
        );
        for (k, v) in &cluster.opts.settings {
            conf += &format!("{k} = {v}\n");
        }
        let conf_path = cluster.opts.data_dir.join("postgresql.conf");
        use std::io::Write;
        std::fs::OpenOptions::new()
            .append(true)
            .open(&conf_path)
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .with_context(|| format!("appending to {}", conf_path.display()))?;
        Ok(cluster)
    }

    /// `pg_ctl -w start -l <logfile>`; the error includes the server log's tail.
    pub fn start(&mut self) -> Result<()> {
        let mut c = self.as_os_user("pg_ctl");
        c.arg("-D")
            .arg(&self.opts.data_dir)
            .arg("-l")
            .arg(self.log_file())
            .args(["-w", "-t", "120", "start"]);
        cmd::run(&mut c)
            .map(|_| ())
            .with_context(|| format!("server log tail:\n{}", self.log_tail(30)))
    }

    /// Starts the postmaster without pg_ctl, as `<wrapper…> postgres -D <data>` (the wrapper,
    /// e.g. strace, becomes its parent), and waits until it accepts connections. Returns the
    /// wrapper's process: wait for it after `stop`.
    pub fn start_under(&mut self, wrapper: &[&str]) -> Result<Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_file())
            .with_context(|| format!("opening {}", self.log_file().display()))?;
        let mut c = Command::new("runuser");
        c.args(["-u", &self.opts.os_user, "--"])
            .args(wrapper)
            .arg(self.opts.bin_dir.join("postgres"))
            .arg("-D")
            .arg(&self.opts.data_dir)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
            .env("LC_ALL", "C")
            .current_dir(self.run_dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let mut child = c
            .spawn()
            .with_context(|| format!("spawning {wrapper:?} postgres"))?;
        let ready = crate::wait_until(Duration::from_secs(120), Duration::from_millis(100), || {
            self.psql("select 1").is_ok()
        });
        if !ready {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{wrapper:?} postgres: not accepting connections after 120 s; server log tail:\n{}",
                self.log_tail(30)
            );
        }
        Ok(child)
    }

    /// `pg_ctl -m fast -w stop`, then waits until the postmaster process is gone
    /// (pg_ctl returns once postmaster.pid is removed, just before the process exits).
    pub fn stop(&mut self) -> Result<()> {
        self.pg_ctl_stop("fast")
    }

    fn pg_ctl_stop(&self, mode: &str) -> Result<()> {
        let pid = self.postmaster_pid().ok();
        let mut c = self.as_os_user("pg_ctl");
        c.arg("-D")
            .arg(&self.opts.data_dir)
            .args(["-m", mode, "-w", "-t", "60", "stop"]);
        cmd::run(&mut c)?;
        if let Some(pid) = pid {
            ensure!(
                crate::wait_until(Duration::from_secs(30), Duration::from_millis(20), || {
                    !pid_alive(pid)
                }),
                "postmaster {pid} still running after pg_ctl stop"
            );
        }
        Ok(())
    }

    /// True while postmaster.pid names a live process.
    pub fn is_running(&self) -> bool {
        self.postmaster_pid().is_ok_and(pid_alive)
    }

    /// First line of postmaster.pid.
    pub fn postmaster_pid(&self) -> Result<u32> {
        let p = self.opts.data_dir.join("postmaster.pid");
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        text.lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .with_context(|| format!("no pid in {}", p.display()))
    }

    /// PIDs of the postmaster's children (checkpointer, walwriter, backends, ...).
    pub fn child_pids(&self) -> Result<Vec<u32>> {
        let pm = self.postmaster_pid()?;
        Ok(processes_with_parent(pm))
    }

    /// Runs `psql -X -A -t -v ON_ERROR_STOP=1 -c sql` as the OS user; returns stdout without
    /// the trailing newline (e.g. "1" for `select 1`).
    pub fn psql(&self, sql: &str) -> Result<String> {
        self.psql_in("postgres", sql)
    }

    /// `psql` in database `db`.
    pub fn psql_in(&self, db: &str, sql: &str) -> Result<String> {
        let mut c = self.as_os_user("psql");
        c.args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1"])
            .args(self.conn_args())
            .args(["-d", db, "-c", sql]);
        Ok(cmd::run(&mut c)?.trim_end_matches('\n').to_owned())
    }

    /// Runs `pgbench -h <socket dir> -p <port> -U postgres <args>` as the OS user and returns
    /// its output whatever the exit status (the error is only for failing to spawn it).
    /// The database defaults to `postgres`.
    pub fn pgbench<S: AsRef<OsStr>>(&self, args: &[S]) -> Result<Output> {
        let mut c = self.as_os_user("pgbench");
        c.args(self.conn_args()).args(args);
        cmd::output(&mut c)
    }

    /// Like `pgbench` but fails unless it exits 0; returns stdout.
    pub fn pgbench_ok<S: AsRef<OsStr>>(&self, args: &[S]) -> Result<String> {
        let mut c = self.as_os_user("pgbench");
        c.args(self.conn_args()).args(args);
        cmd::run(&mut c)
    }

    /// A long-lived `psql -X -q -d <database> -U <user>` run as the OS user that reads SQL from
    /// a pipe (`PsqlSession::send`); its server backend lives until the session is dropped.
    /// psql connects before reading its input, so the backend exists shortly after this
    /// returns (poll `pg_stat_activity` to be sure).
    pub fn session(&self, database: &str, user: &str) -> Result<PsqlSession> {
        use std::os::unix::process::CommandExt;
        let mut c = Command::new(self.opts.bin_dir.join("psql"));
        c.args(["-X", "-q", "-h"])
            .arg(self.socket_dir())
            .args([
                "-p",
                &self.opts.port.to_string(),
                "-U",
                user,
                "-d",
                database,
            ])
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
            .env("LC_ALL", "C")
            .current_dir(self.run_dir.path())
            .uid(self.uid)
            .gid(self.gid)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let mut child = c
            .spawn()
            .with_context(|| format!("spawning `{}`", cmd::describe(&c)))?;
        let stdin = child.stdin.take();
        Ok(PsqlSession { child, stdin })
    }

    /// A command running `<bin_dir>/<tool>` as the OS user via `runuser -u <user> --`, with
    /// a clean environment (no PG* variables) and the private run dir as working directory.
    pub fn as_os_user(&self, tool: &str) -> Command {
        let mut c = Command::new("runuser");
        c.args(["-u", &self.opts.os_user, "--"])
            .arg(self.opts.bin_dir.join(tool))
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
            .env("LC_ALL", "C")
            .current_dir(self.run_dir.path());
        c
    }

    /// `-h <socket dir> -p <port> -U postgres`.
    pub fn conn_args(&self) -> Vec<String> {
        vec![
            "-h".into(),
            self.socket_dir().to_string_lossy().into_owned(),
            "-p".into(),
            self.opts.port.to_string(),
            "-U".into(),
            "postgres".into(),
        ]
    }

    pub fn data_dir(&self) -> &Path {
        &self.opts.data_dir
    }

    pub fn socket_dir(&self) -> &Path {
        self.run_dir.path()
    }

    pub fn port(&self) -> u16 {
        self.opts.port
    }

    pub fn log_file(&self) -> PathBuf {
        self.run_dir.path().join("postgres.log")
    }

    pub fn os_user_ids(&self) -> (u32, u32) {
        (self.uid, self.gid)
    }

    /// Last `n` lines of the server log (empty if there is none yet).
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(self.log_file()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    fn shut_down_for_drop(&self) {
        if !self.opts.data_dir.join("postmaster.pid").exists() {
            return;
        }
        let Err(fast) = self.pg_ctl_stop("fast") else {
            return;
        };
        eprintln!(
            "pgio-testkit: fast stop of {} failed: {fast:#}",
            self.opts.data_dir.display()
        );
        let Err(immediate) = self.pg_ctl_stop("immediate") else {
            return;
        };
        eprintln!("pgio-testkit: immediate stop failed: {immediate:#}");
        let Ok(pid) = self.postmaster_pid() else {
            return;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() != "postgres" {
            return; // not running (stale pid file), or the pid now belongs to someone else
        }
        eprintln!("pgio-testkit: killing postmaster {pid}");
        // SAFETY: plain kill(2) of the postmaster of this cluster.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        if !crate::wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            !pid_alive(pid)
        }) {
            eprintln!("pgio-testkit: postmaster {pid} still alive after SIGKILL");
        }
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "pgio-testkit: server log tail of {}:\n{}",
                self.opts.data_dir.display(),
                self.log_tail(40)
            );
        }
        self.shut_down_for_drop();
    }
}

/// A `psql` child from `PgCluster::session`. Drop kills it (SIGKILL, this child only) and
/// reaps it; the server ends its backend when the connection closes.
#[derive(Debug)]
pub struct PsqlSession {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl PsqlSession {
    /// PID of the psql client (not of its server backend).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Writes `sql` and a newline to psql's input; psql runs it once it reads a complete
    /// statement (end it with `;`). Output goes to /dev/null, errors to stderr.
    pub fn send(&mut self, sql: &str) -> Result<()> {
        use std::io::Write;
        let stdin = self.stdin.as_mut().context("psql input closed")?;
        stdin
            .write_all(sql.as_bytes())
            .and_then(|_| stdin.write_all(b"\n"))
            .and_then(|_| stdin.flush())
            .context("writing to psql")
    }
}

impl Drop for PsqlSession {
    fn drop(&mut self) {
        self.stdin = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn escape_conf(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\'', "''")
}

/// (uid, gid) of an OS user.
pub(crate) fn user_ids(user: &str) -> Result<(u32, u32)> {
    let name = CString::new(user).context("user name contains NUL")?;
    // SAFETY: getpwnam_r with a caller-provided buffer; all pointers live for the call.
    unsafe {
        let mut pwd: libc::passwd = std::mem::zeroed();
        let mut buf = vec![0 as libc::c_char; 16 * 1024];
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwnam_r(
            name.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        );
        ensure!(
            rc == 0,
            "getpwnam_r({user}) failed: {}",
            std::io::Error::from_raw_os_error(rc)
        );
        ensure!(!result.is_null(), "OS user {user:?} does not exist");
        Ok((pwd.pw_uid, pwd.pw_gid))
    }
}

/// Every existing ancestor of `path` must be searchable by `uid` (world-x or owned by it).
pub(crate) fn check_traversable(path: &Path, uid: u32) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    for dir in path.ancestors().skip(1) {
        let Ok(md) = std::fs::metadata(dir) else {
            continue;
        };
        if md.mode() & 0o001 == 0 && md.uid() != uid {
            bail!(
                "{} (mode {:o}) is not searchable by uid {uid}, so PostgreSQL cannot reach {}; \
                 create temp dirs with pgio_testkit::temp_dir() (mode 0755)",
                dir.display(),
                md.mode() & 0o7777,
                path.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_conf_strings() {
        assert_eq!(escape_conf(r"/tmp/a'b\c"), r"/tmp/a''b\\c");
    }

    #[test]
    fn rejects_untraversable_parent() {
        let d = tempfile::Builder::new()
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .unwrap();
        let uid = unsafe { libc::geteuid() } + 1;
        assert!(check_traversable(&d.path().join("data"), uid).is_err());
        assert!(check_traversable(&d.path().join("data"), uid - 1).is_ok());
    }
}
