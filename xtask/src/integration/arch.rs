//! What differs between the guests of `cargo xtask integration` by CPU architecture; the rest
//! (initramfs, guest script, results share, report) is the same code for all.

use crate::cross::Arch;

pub struct Guest {
    /// The emulator, and the Debian package that has it.
    pub qemu: &'static str,
    pub qemu_package: &'static str,
    /// Machine, accelerator and CPU flags.
    pub machine: &'static [&'static str],
    /// The serial console the kernel writes to (`-serial file:` is its first UART).
    pub console: &'static str,
    /// Whether `-smp 2,maxcpus=N` makes N possible CPUs (x86's ACPI hotplug); arm's `virt`
    /// machine has no CPU hotplug, so its possible CPUs are the online ones.
    pub hotplug_cpus: bool,
    /// The guest runs the host's own root filesystem; otherwise one built from Debian's
    /// packages of its architecture (`rootfs.rs`) with the workspace as a second share.
    pub host_root: bool,
}

pub const AMD64: Guest = Guest {
    qemu: "qemu-system-x86_64",
    qemu_package: "qemu-system-x86",
    machine: &["-accel", "tcg,thread=multi", "-cpu", "max"],
    console: "ttyS0",
    hotplug_cpus: true,
    host_root: true,
};

pub const ARM64: Guest = Guest {
    qemu: "qemu-system-aarch64",
    qemu_package: "qemu-system-arm",
    // GICv3: GICv2 stops at 8 CPUs. pauth-impdef: TCG's architected pointer-authentication
    // hash (QARMA) costs a large share of the guest's time; the implementation-defined one is
    // still pointer authentication to the guest.
    machine: &[
        "-M",
        "virt,gic-version=3",
        "-accel",
        "tcg,thread=multi",
        "-cpu",
        "max,pauth-impdef=on",
    ],
    console: "ttyAMA0",
    hotplug_cpus: false,
    host_root: false,
};

pub fn guest(arch: Arch) -> &'static Guest {
    match arch {
        Arch::Amd64 => &AMD64,
        Arch::Arm64 => &ARM64,
    }
}
