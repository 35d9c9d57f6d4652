//! Longhorn device → volume map on real device nodes: a block node named after a volume, with
//! the major:minor of a real loop device, maps that device to the volume; removing the node
//! makes the next refresh forget it. Root only (mknod, losetup).
use std::{ffi::CString, os::unix::ffi::OsStrExt, path::Path};

use pgio_common::block_io::mkdev;
use pgio_daemon::devices::LonghornVolumes;
use pgio_testkit::{LoopDevice, require_root, temp_dir};

fn mknod_block(path: &Path, (major, minor): (u32, u32)) -> std::io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: valid NUL-terminated path; plain integer arguments.
    let rc = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFBLK | 0o600,
            libc::makedev(major, minor),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn device_nodes_map_to_volumes_and_refresh_forgets_removed_ones() {
    if !require_root("longhorn_device_map") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    // Detached on drop, also when an assertion below fails.
    let lo = LoopDevice::create(dir.path(), 1 << 20, false).expect("loop device");
    let (major, minor) = lo.major_minor();
    let dev = mkdev(major, minor);

    let lh_dir = dir.path().join("longhorn");
    let mut volumes = LonghornVolumes::new(Some(lh_dir.clone()));
    volumes.refresh();
    assert_eq!(volumes.iter().count(), 0, "missing directory: no volumes");

    std::fs::create_dir(&lh_dir).expect("device dir");
    let node = lh_dir.join("pvc-test");
    mknod_block(&node, (major, minor)).expect("mknod");
    // A symlink to the loop device, as some tools create: same device, later name loses.
    std::os::unix::fs::symlink(lo.path(), lh_dir.join("pvc-test-link")).expect("symlink");
    std::fs::write(lh_dir.join("not-a-device"), b"x").expect("file");
    volumes.refresh();
    assert_eq!(volumes.volume(dev), Some("pvc-test"), "{:?}", lo.path());
    assert_eq!(volumes.iter().collect::<Vec<_>>(), [(dev, "pvc-test")]);

    std::fs::remove_file(&node).expect("remove node");
    volumes.refresh();
    assert_eq!(
        volumes.volume(dev),
        Some("pvc-test-link"),
        "the symlink still names the device"
    );
    std::fs::remove_file(lh_dir.join("pvc-test-link")).expect("remove link");
    volumes.refresh();
    assert_eq!(volumes.volume(dev), None, "refresh forgets removed nodes");
    assert_eq!(volumes.iter().count(), 0);

    lo.detach().expect("detach");
}
