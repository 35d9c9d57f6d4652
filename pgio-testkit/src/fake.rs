//! A process anyone could start, for hostile-input tests: a small C program (compiled once
//! per test with `cc`) that runs under any name and user, rewrites its command line the way
//! Postgres writes its title, and does a known number of `pread64`s when told to.
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

use anyhow::{Context as _, Result, ensure};

/// The unprivileged user attackers run as.
pub const NOBODY: u32 = 65_534;

/// `FAKE_CHILDREN` unset: waits for a byte on stdin, does `FAKE_READS` pread64 of `FAKE_FILE`,
/// prints `done`, then waits for stdin to close. Set: forks that many children, each of which
/// writes `FAKE_TITLE` (with its index for `%d`) over the command line like Postgres, and does
/// the same without waiting for the byte; the parent waits for stdin to close. `FAKE_SPREAD`
/// rounds of futex waits timing out after 2^10 … 2^30 ns come first: 21 latency slots, so 21
/// histogram keys per series (2.1 s a round). `FAKE_CONNECT` (`a.b.c.d:port`) with
/// `FAKE_CONNECTIONS` set: opens that many TCP connections there and holds them, prints how
/// many it opened, then waits for stdin to close. `FAKE_REOPEN` set: the file is closed and
/// opened again after each read (an `openat` storm on fd slots that hold counts).
pub const FAKE_C: &str = r#"
#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void spread(void) {
    long rounds = atol(getenv("FAKE_SPREAD") ? getenv("FAKE_SPREAD") : "0");
    static int word;
    for (long r = 0; r < rounds; r++)
        for (int k = 10; k <= 30; k++) {
            struct timespec ts = { (1L << k) / 1000000000L, (1L << k) % 1000000000L };
            syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, 0, &ts, NULL, 0);
        }
}

static void reads(void) {
    spread();
    const char *file = getenv("FAKE_FILE");
    long n = atol(getenv("FAKE_READS") ? getenv("FAKE_READS") : "0");
    char buf[4096];
    int reopen = getenv("FAKE_REOPEN") != NULL;
    int fd = file ? open(file, O_RDONLY) : -1;
    for (long i = 0; fd >= 0 && i < n; i++) {
        pread(fd, buf, sizeof buf, 0);
        if (reopen) {
            close(fd);
            fd = open(file, O_RDONLY);
        }
    }
    printf("done\n");
    fflush(stdout);
}

static void wait_eof(void) {
    char c;
    while (read(0, &c, 1) > 0) {}
}

static void hold_connections(const char *to, long n) {
    char ip[64];
    int port = 0;
    if (sscanf(to, "%63[^:]:%d", ip, &port) != 2) exit(2);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
    if (inet_pton(AF_INET, ip, &a.sin_addr) != 1) exit(2);
    long held = 0;
    for (long i = 0; i < n; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) break;
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) held++;
        else close(fd);
    }
    printf("%ld\n", held);
    fflush(stdout);
    wait_eof();
}

int main(int argc, char **argv) {
    if (getenv("FAKE_CONNECT") && getenv("FAKE_CONNECTIONS")) {
        hold_connections(getenv("FAKE_CONNECT"), atol(getenv("FAKE_CONNECTIONS")));
        return 0;
    }
    const char *children = getenv("FAKE_CHILDREN");
    if (!children) {
        char c;
        if (read(0, &c, 1) == 1) reads();
        wait_eof();
        return 0;
    }
    char *area = argv[0];
    size_t len = (size_t)(argv[argc - 1] + strlen(argv[argc - 1]) - area);
    for (int i = 0; i < atoi(children); i++) {
        if (fork() == 0) {
            int n = snprintf(area, len, getenv("FAKE_TITLE"), i);
            if (n >= 0 && (size_t)n < len) memset(area + n, 0, len - n);
            usleep(1500 * 1000);
            reads();
            wait_eof();
            _exit(0);
        }
    }
    wait_eof();
    while (wait(NULL) > 0) {}
    return 0;
}
"#;

/// The fixture compiled as `<dir>/<name>` (the name is its comm), owned by nobody.
pub fn compile(dir: &Path, name: &str) -> Result<PathBuf> {
    let src = dir.join("fake.c");
    std::fs::write(&src, FAKE_C).context("writing fake.c")?;
    let bin = dir.join(name);
    let out = Command::new("cc")
        .arg("-O1")
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .output()
        .context("running cc")?;
    ensure!(
        out.status.success(),
        "cc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    chown_nobody(&bin)?;
    Ok(bin)
}

pub fn chown_nobody(p: &Path) -> Result<()> {
    std::os::unix::fs::chown(p, Some(NOBODY), Some(NOBODY))
        .with_context(|| format!("chown nobody {}", p.display()))
}

/// The attacker's files under `<dir>/fakes`, all nobody's: the fixture compiled as each of
/// `names`, an 8 KiB file to read, and a data directory of its own (with `PG_VERSION`). `dir`
/// itself becomes world-searchable so nobody can pass through it.
pub struct AttackerFiles {
    pub dir: PathBuf,
    pub data: PathBuf,
    pub file: PathBuf,
}

impl AttackerFiles {
    pub fn create(dir: &Path, names: &[&str]) -> Result<AttackerFiles> {
        use std::os::unix::fs::PermissionsExt;
        let fakes = dir.join("fakes");
        let data = fakes.join("data");
        std::fs::create_dir_all(&data).context("the made-up data directory")?;
        std::fs::write(data.join("PG_VERSION"), "15\n").context("PG_VERSION")?;
        let file = fakes.join("file");
        std::fs::write(&file, vec![7u8; 8192]).context("the file to read")?;
        for name in names {
            compile(&fakes, name)?;
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
            .context("chmod 755")?;
        for p in [&fakes, &data, &data.join("PG_VERSION"), &file] {
            chown_nobody(p)?;
        }
        Ok(AttackerFiles {
            dir: fakes,
            data,
            file,
        })
    }

    pub fn bin(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// A fixture process run by nobody; stdin closed (dropped) ends it and its children.
pub struct Fake {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<std::process::ChildStdout>,
}

impl Fake {
    /// `bin` as nobody with command line `argv0 args…` in `cwd`, with only `env`.
    pub fn start(
        bin: &Path,
        argv0: &str,
        args: &[&str],
        cwd: &Path,
        env: &[(&str, &str)],
    ) -> Result<Fake> {
        Fake::start_as(NOBODY, bin, argv0, args, cwd, env)
    }

    /// The same as user and group `id` (0: a root-owned made-up cluster).
    pub fn start_as(
        id: u32,
        bin: &Path,
        argv0: &str,
        args: &[&str],
        cwd: &Path,
        env: &[(&str, &str)],
    ) -> Result<Fake> {
        let mut c = Command::new(bin);
        c.arg0(argv0)
            .args(args)
            .current_dir(cwd)
            .env_clear()
            .uid(id)
            .gid(id)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        let mut child = c.spawn().context("starting a fake process")?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().context("its stdout")?);
        Ok(Fake {
            child,
            stdin,
            stdout,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Tells it to read, and waits for `done` from `n` processes (itself or its children).
    pub fn go_and_wait(&mut self, n: usize) -> Result<()> {
        if let Some(stdin) = self.stdin.as_mut() {
            stdin.write_all(b"g").context("telling the fake to go")?;
        }
        self.wait_done(n)
    }

    /// Waits for `done` from `n` processes.
    pub fn wait_done(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            let mut line = String::new();
            self.stdout.read_line(&mut line).context("reading done")?;
            ensure!(line == "done\n", "fake said {line:?}, not done");
        }
        Ok(())
    }

    /// The next line it prints.
    pub fn line(&mut self) -> Result<String> {
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .context("reading its output")?;
        Ok(line.trim_end().to_owned())
    }

    /// Closes its stdin and waits for it (its children end with it).
    pub fn end(&mut self) {
        self.stdin.take();
        let _ = self.child.wait();
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.stdin.take();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
