//! Smoke tests of the fixtures against the real kernel (loop devices, ext4, PostgreSQL 15).
//! The root-only tests skip without root unless PGIO_REQUIRE_ROOT_TESTS is set.

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, ensure};
use pgio_testkit::{
    Ext4Mount, LoadProcess, LoopDevice, PG15_BIN_DIR, PgCluster, PgOptions, diskstats,
    pgio_load_bin, pid_alive, processes_with_cmdline_containing, require_root, temp_dir,
};

const MIB: u64 = 1 << 20;

fn losetup_lists(backing: &Path) -> Result<bool> {
    let out = std::process::Command::new("losetup").arg("-a").output()?;
    ensure!(out.status.success(), "losetup -a failed");
    Ok(String::from_utf8_lossy(&out.stdout).contains(&*backing.to_string_lossy()))
}

fn is_mounted(mountpoint: &Path) -> Result<bool> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mp = mountpoint.to_string_lossy();
    Ok(info.lines().any(|l| l.split(' ').nth(4) == Some(&*mp)))
}

#[test]
fn pgio_load_bin_is_this_crates_binary() {
    let bin = pgio_load_bin().unwrap();
    assert_eq!(bin, Path::new(env!("CARGO_BIN_EXE_pgio-load")));
}

#[test]
fn pread_and_futex_load_report_their_counts() -> Result<()> {
    let dir = temp_dir()?;
    let file = dir.path().join("data");
    std::fs::write(&file, vec![7u8; 64 * 1024])?;
    let bin = pgio_load_bin()?;

    let mut load = LoadProcess::spawn(
        &bin,
        [
            "pread".as_ref(),
            file.as_os_str(),
            "5".as_ref(),
            "3".as_ref(),
        ],
    )?;
    assert_ne!(load.pid(), std::process::id());
    load.go()?;
    assert_eq!(load.wait_done()?, 8);

    let mut load = LoadProcess::spawn(&bin, ["futex-wait", "3", "20"])?;
    let t = std::time::Instant::now();
    assert_eq!(load.expect_run(), 3);
    assert!(t.elapsed() >= Duration::from_millis(60));

    // A failing generator is reported, not hung on.
    assert!(LoadProcess::spawn(&bin, ["pread", "/nonexistent/file", "1", "1"]).is_err());
    // Dropping a generator that never got `go` kills it.
    let load = LoadProcess::spawn(&bin, ["futex-wait", "1", "1"])?;
    let pid = load.pid();
    drop(load);
    assert!(!pid_alive(pid));
    Ok(())
}

#[test]
fn direct_reads_on_a_loop_device_show_in_diskstats() -> Result<()> {
    if !require_root("direct_reads_on_a_loop_device_show_in_diskstats") {
        return Ok(());
    }
    let dir = temp_dir()?;
    let dev = LoopDevice::create(dir.path(), 64 * MIB, true)?;
    let backing = dev.backing_file().to_owned();
    assert!(dev.path().starts_with("/dev") && dev.name().starts_with("loop"));
    assert_eq!(dev.major_minor().0, 7, "loop major");
    dev.wait_quiet(Duration::from_secs(5));

    let dev_arg = dev.path().to_string_lossy().into_owned();
    let mut load = LoadProcess::spawn(
        &pgio_load_bin()?,
        ["direct-read", dev_arg.as_str(), "2000", "8192"],
    )?;
    let before = diskstats(dev.name())?;
    load.go()?;
    assert_eq!(load.wait_done()?, 2000);
    let after = diskstats(dev.name())?;
    let reads = after.reads_completed - before.reads_completed;
    eprintln!("direct-read: reads_completed delta {reads}");
    assert!(
        (2000..=2020).contains(&reads),
        "reads_completed delta {reads}"
    );
    let sectors = after.sectors_read - before.sectors_read;
    assert!(sectors >= 2000 * 16, "sectors_read delta {sectors}");

    dev.detach()?;
    assert!(!losetup_lists(&backing)?, "loop device still attached");
    Ok(())
}

#[test]
fn postgres15_on_ext4_on_loop() -> Result<()> {
    if !require_root("postgres15_on_ext4_on_loop") {
        return Ok(());
    }
    let dir = temp_dir()?;
    let dev = LoopDevice::create(dir.path(), 512 * MIB, true)?;
    let backing = dev.backing_file().to_owned();
    let mountpoint = dir.path().join("mnt");
    let mut mnt = Ext4Mount::new(&dev, &mountpoint)?;
    assert!(is_mounted(&mountpoint)?);
    let data_dir = mnt.path().join("pgdata");
    let data_dir_str = data_dir.to_string_lossy().into_owned();

    let (postmaster, children) = {
        let mut pg = PgCluster::init_with(
            PgOptions::new(PG15_BIN_DIR, &data_dir, 54329).shared_buffers("32MB"),
        )?;
        pg.start()?;
        assert!(pg.is_running());
        assert_eq!(pg.psql("select 1")?, "1");
        assert_eq!(pg.psql("show shared_buffers")?, "32MB");
        assert_eq!(pg.psql("show listen_addresses")?, "");
        let out = pg.pgbench(&["-i", "-s", "1", "-q"])?;
        assert!(
            out.status.success(),
            "pgbench -i: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(pg.psql("select count(*) from pgbench_accounts")?, "100000");
        let postmaster = pg.postmaster_pid()?;
        let children = pg.child_pids()?;
        assert!(!children.is_empty(), "postmaster has no children");
        assert_eq!(
            processes_with_cmdline_containing(&data_dir_str),
            vec![postmaster]
        );
        pg.stop()?;
        assert!(!pg.is_running());
        (postmaster, children)
    };
    for pid in std::iter::once(postmaster).chain(children) {
        assert!(!pid_alive(pid), "postgres pid {pid} still alive");
    }
    assert!(processes_with_cmdline_containing(&data_dir_str).is_empty());

    // Remount (cold cache) keeps the data.
    mnt.remount()?;
    assert!(data_dir.join("PG_VERSION").exists());

    drop(mnt);
    assert!(!is_mounted(&mountpoint)?);
    drop(dev);
    assert!(!losetup_lists(&backing)?, "loop device still attached");
    Ok(())
}

#[test]
fn fixtures_clean_up_when_a_test_panics() -> Result<()> {
    if !require_root("fixtures_clean_up_when_a_test_panics") {
        return Ok(());
    }
    let dir = temp_dir()?;
    let mountpoint = dir.path().join("mnt");
    let data_dir = mountpoint.join("pgdata");
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::panic::catch_unwind(|| {
        let dev = LoopDevice::create(dir.path(), 256 * MIB, false).unwrap();
        let mnt = Ext4Mount::new(&dev, &mountpoint).unwrap();
        let mut pg =
            PgCluster::init(Path::new(PG15_BIN_DIR), &mnt.path().join("pgdata"), 54330).unwrap();
        pg.start().unwrap();
        tx.send((dev.backing_file().to_owned(), pg.postmaster_pid().unwrap()))
            .unwrap();
        panic!("deliberate panic with a running server");
    });
    assert!(result.is_err());
    let (backing, postmaster) = rx.recv()?;
    assert!(!pid_alive(postmaster), "postmaster survived the panic");
    assert!(processes_with_cmdline_containing(&data_dir.to_string_lossy()).is_empty());
    assert!(!is_mounted(&mountpoint)?);
    assert!(!losetup_lists(&backing)?);
    Ok(())
}
