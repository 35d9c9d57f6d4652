#!/bin/busybox sh
# Stage 1, /init of the guest's initramfs (written by xtask/src/integration.rs): load the modules
# the root filesystem needs, mount the host's root read-only over 9p under a tmpfs overlay, and
# hand over to busybox init in it (it reaps orphans, which a shell as PID 1 would not: tests
# check that processes are gone). /config sets KVER, MODDIR, GUEST_SCRIPT, BUSYBOX and
# WORKSPACE_SHARE.
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /lower /rw /newroot
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
. /config

fail() {
    echo "pgio-init: $*" >&2
    echo o >/proc/sysrq-trigger
    sleep 10
}

while read -r m; do
    insmod "/modules/$m" || fail "insmod $m failed"
done </modules/order

# msize: 9p's default (8 KiB) makes every read of a binary or library a round trip.
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=524288 hostroot /lower ||
    fail "cannot mount the host root over 9p"
mount -t tmpfs -o mode=0755 tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot ||
    fail "cannot mount the overlay"

# A guest of another architecture than the host's boots a root built for it: the workspace (the
# binaries, the guest script, the kernel's modules) comes as a second share, at its own path,
# writable the same way (tmpfs overlay).
if [ -n "${WORKSPACE_SHARE:-}" ]; then
    mkdir -p /wslower "/newroot$WORKSPACE_SHARE" /rw/wsupper /rw/wswork
    mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=524288 workspace /wslower ||
        fail "cannot mount the workspace over 9p"
    mount -t overlay overlay -o lowerdir=/wslower,upperdir=/rw/wsupper,workdir=/rw/wswork \
        "/newroot$WORKSPACE_SHARE" || fail "cannot mount the workspace overlay"
fi

# The guest kernel's modules where modprobe looks for them.
mkdir -p "/newroot/lib/modules/$KVER"
mount --bind "/newroot$MODDIR" "/newroot/lib/modules/$KVER" || fail "cannot bind $MODDIR"

# busybox init runs only this (no getty, no rc scripts of the host).
printf '::once:/bin/sh %s\n' "$GUEST_SCRIPT" >/newroot/etc/inittab
for d in proc sys dev; do
    mount --move "/$d" "/newroot/$d"
done
exec switch_root /newroot "$BUSYBOX" init
