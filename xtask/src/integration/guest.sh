#!/bin/sh
# Stage 2 of `cargo xtask integration`, run by busybox init inside the guest on the host's root
# (read-only 9p + tmpfs overlay): set up what a booted Debian would have, run each test binary
# the host listed in /results/run.env, write one line per test to /results/summary, power off.
# Everything of a run goes to the writable 9p share at /results.
set -u
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

log() { echo "pgio-guest: $*" >/dev/console; }
poweroff_now() {
    sync
    echo o >/proc/sysrq-trigger
    sleep 30
}

mkdir -p /results
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 results /results || {
    log "cannot mount the results share"
    poweroff_now
}
echo "$(cut -d' ' -f1 /proc/uptime)" >/results/booted
# shellcheck disable=SC1091
. /results/run.env

mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts 2>/dev/null || {
    mkdir -p /dev/pts
    mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
}
mkdir -p /dev/shm /dev/mqueue
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
ln -sf /proc/self/fd /dev/fd
ln -sf /proc/self/fd/0 /dev/stdin
ln -sf /proc/self/fd/1 /dev/stdout
ln -sf /proc/self/fd/2 /dev/stderr
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/lock /run/postgresql
chown postgres:postgres /run/postgresql 2>/dev/null
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
mount -t securityfs securityfs /sys/kernel/security 2>/dev/null
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
ip link set lo up
hostname pgio-guest

# The scratch disk (ext4, made on the host) is /tmp: tmpfs has no O_DIRECT before 6.6, and the
# tests' direct-IO loop devices need it under their backing files.
for m in $GUEST_MODULES; do
    modprobe "$m" || log "modprobe $m failed"
done
# A workspace under /tmp (a clone made there) would be hidden by it: bind it back.
case "$WORKSPACE" in
/tmp/*) mkdir -p /.host-tmp && mount -o bind /tmp /.host-tmp ;;
esac
mount -t ext4 /dev/vda /tmp || {
    log "cannot mount the scratch disk on /tmp"
    poweroff_now
}
chmod 1777 /tmp
case "$WORKSPACE" in
/tmp/*)
    mkdir -p "$WORKSPACE" && mount -o bind "/.host-tmp${WORKSPACE#/tmp}" "$WORKSPACE" || {
        log "cannot bind $WORKSPACE over the scratch disk"
        poweroff_now
    }
    ;;
esac

{
    echo "kernel $(uname -r)"
    echo "cpus $(nproc)"
    echo "possible cpus $(cat /sys/devices/system/cpu/possible)"
    echo "cmdline $(cat /proc/cmdline)"
    echo "perf_event_paranoid $(cat /proc/sys/kernel/perf_event_paranoid)"
    echo "lockdown $(cat /sys/kernel/security/lockdown 2>/dev/null || echo absent)"
} >/results/guest-info
"$PGIO_DAEMON" check >/results/check.log 2>&1
check_rc=$?
echo "$check_rc" >/results/check.rc

# PGIO_TEST_EMULATED: bars on absolute latencies of userspace IO paths do not hold under TCG.
export HOME=/root PGIO_REQUIRE_ROOT_TESTS=1 RUST_BACKTRACE=1 PGIO_TEST_EMULATED=tcg
export PGIO_LOAD_BIN PGIO_LONGHORN_BIN_DIR PGIO_PG_DIST PGIO_TEST_SPARE_DISK PGIO_TEST_POSSIBLE_CPUS
cd /tmp || poweroff_now
: >/results/summary
# TESTS: lines "name binary filter…"
echo "$TESTS" | while read -r name bin filters; do
    [ -n "$name" ] || continue
    # pgio cannot start on this kernel (check.log says why): every test would only wait a
    # minute for the daemon and fail the same way.
    if [ "$check_rc" != 0 ] && [ "$RUN_IF_CHECK_FAILS" != 1 ]; then
        echo "$name skipped 0 0" >>/results/summary
        continue
    fi
    log "test $name: start"
    start=$(cut -d' ' -f1 /proc/uptime)
    # shellcheck disable=SC2086
    timeout "$TEST_TIMEOUT" "$bin" --nocapture --test-threads=1 $filters \
        >"/results/$name.log" 2>&1 </dev/null
    rc=$?
    end=$(cut -d' ' -f1 /proc/uptime)
    echo "$name $rc $start $end" >>/results/summary
    log "test $name: exit $rc"
    sync
done
echo done >/results/finished
poweroff_now
