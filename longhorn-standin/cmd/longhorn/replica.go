package main

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"pgio/longhorn-standin/internal/wire"
)

// directAlign is the buffer, offset and length alignment used for O_DIRECT. 4 KiB satisfies
// every logical block size a backing filesystem may have; the frontend sends 512-byte
// sectors, so requests that are not 4 KiB aligned are widened (reads) or read-modify-written.
const directAlign = 4096

const headName = "volume-head-000.img"

type replica struct {
	head    int // volume-head-000.img, O_DIRECT
	revFd   int // revision.counter, O_DIRECT
	size    uint64
	latency time.Duration

	// Aligned writes share the lock; a read-modify-write of a partial block takes it alone
	// so it cannot lose a concurrent write to the same block.
	rmw sync.RWMutex

	revision                                     atomic.Uint64
	reads, writes, unmaps, readBytes, writeBytes atomic.Uint64
	inflight                                     inflight // until the reply is sent
}

func runReplica(g globals, args []string) error {
	fs := flag.NewFlagSet("replica", flag.ContinueOnError)
	size := fs.Uint64("size", 0, "volume size in bytes")
	listen := fs.String("listen", "", "data address HOST:PORT")
	instance := fs.String("replica-instance-name", "", "replica instance name")
	volume := fs.String("volume-name", g.volumeName, "volume name (older argv puts it here)")
	latency := fs.Duration("inject-latency", g.injectLatency, "sleep this long per request before replying")
	ignoreFlags(fs,
		[]string{"restore-from", "restore-name", "snapshot-max-count", "snapshot-max-size",
			"sync-agent-port-count", "data-server-protocol", "replica-disk-name", "backing-file"},
		[]string{"disableRevCounter", "unmap-mark-disk-chain-removed", "data-server-direct-io"})
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("want exactly one replica directory, got %q", pos)
	}
	if *size == 0 || *size%512 != 0 || *listen == "" {
		return errors.New("--size (a positive multiple of 512) and --listen are required")
	}
	dir := pos[0]
	r, err := openReplica(dir, *size, *latency)
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	logf("replica %s (volume %q, instance %q) size %d latency %v listening on %s",
		dir, *volume, *instance, *size, *latency, l.Addr())
	go acceptLoop(l, alignedBuf, r.handle)
	ready("replica", l.Addr().String())
	logf("replica: %v, exiting", waitForSignal())
	return nil
}

// openReplica creates (or reopens) the replica directory like a fresh Longhorn replica: a
// sparse head file of the volume size, a revision counter and the metadata files.
func openReplica(dir string, size uint64, latency time.Duration) (*replica, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	head, err := unix.Open(filepath.Join(dir, headName), unix.O_RDWR|unix.O_CREAT|unix.O_DIRECT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", headName, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(head, &st); err != nil {
		return nil, err
	}
	if uint64(st.Size) < size {
		if err := unix.Ftruncate(head, int64(size)); err != nil {
			return nil, fmt.Errorf("sizing %s: %w", headName, err)
		}
	}
	rev, err := unix.Open(filepath.Join(dir, "revision.counter"), unix.O_RDWR|unix.O_CREAT|unix.O_DIRECT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening revision.counter: %w", err)
	}
	meta := fmt.Sprintf(`{"Size":%d,"Head":%q,"Dirty":true,"Rebuilding":false,"Error":"","Parent":"","SectorSize":512,"BackingFilePath":""}`+"\n", size, headName)
	if err := os.WriteFile(filepath.Join(dir, "volume.meta"), []byte(meta), 0o600); err != nil {
		return nil, err
	}
	headMeta := fmt.Sprintf(`{"Name":%q,"Parent":"","Removed":false,"UserCreated":false,"Created":%q,"Labels":null}`+"\n",
		headName, time.Now().UTC().Format(time.RFC3339))
	if err := os.WriteFile(filepath.Join(dir, headName+".meta"), []byte(headMeta), 0o600); err != nil {
		return nil, err
	}
	r := &replica{head: head, revFd: rev, size: size, latency: latency}
	return r, r.writeRevision()
}

// acceptLoop serves every connection with its own wire.Serve (the engine opens two).
func acceptLoop(l net.Listener, alloc func(int) []byte, h wire.Handler) {
	for {
		conn, err := l.Accept()
		if err != nil {
			logf("accept: %v", err)
			return
		}
		if tc, ok := conn.(*net.TCPConn); ok {
			_ = tc.SetNoDelay(true)
		}
		go func() {
			if err := wire.Serve(conn, alloc, h); err != nil {
				logf("connection %s: %v", conn.RemoteAddr(), err)
			}
		}()
	}
}

func (r *replica) handle(req *wire.Request) ([]byte, syscall.Errno) {
	if req.Op != wire.OpStats {
		r.inflight.enter()
		defer r.inflight.leave()
	}
	data, errno := r.serve(req)
	if r.latency > 0 && req.Op != wire.OpStats {
		// After the IO, before the reply: the engine (and everything above it) sees the
		// request take this much longer, the replica's own syscalls do not.
		time.Sleep(r.latency)
	}
	if errno != 0 {
		logf("op %d off %d len %d: %v", req.Op, req.Offset, req.Length, errno)
	}
	return data, errno
}

func (r *replica) serve(req *wire.Request) ([]byte, syscall.Errno) {
	switch req.Op {
	case wire.OpStats:
		return []byte(fmt.Sprintf("reads=%d writes=%d unmaps=%d read_bytes=%d write_bytes=%d revision=%d inflight=%d max_inflight=%d\n",
			r.reads.Load(), r.writes.Load(), r.unmaps.Load(), r.readBytes.Load(), r.writeBytes.Load(),
			r.revision.Load(), r.inflight.cur.Load(), r.inflight.max.Load())), 0
	case wire.OpFlush:
		return nil, errnoOf(unix.Fdatasync(r.head))
	}
	if req.Offset+uint64(req.Length) > r.size || req.Offset%512 != 0 || req.Length%512 != 0 {
		return nil, syscall.EINVAL
	}
	switch req.Op {
	case wire.OpRead:
		r.reads.Add(1)
		r.readBytes.Add(uint64(req.Length))
		return r.read(req.Offset, int(req.Length))
	case wire.OpWrite:
		r.writes.Add(1)
		r.writeBytes.Add(uint64(req.Length))
		return nil, r.write(req.Offset, req.Data)
	case wire.OpUnmap:
		r.unmaps.Add(1)
		r.rmw.RLock()
		defer r.rmw.RUnlock()
		return nil, errnoOf(unix.Fallocate(r.head, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE,
			int64(req.Offset), int64(req.Length)))
	}
	return nil, syscall.EOPNOTSUPP
}

// read is one fstat + one O_DIRECT pread64, like the real replica's per-read path (it stats
// the head file to check it is still there).
func (r *replica) read(off uint64, n int) ([]byte, syscall.Errno) {
	var st unix.Stat_t
	if err := unix.Fstat(r.head, &st); err != nil {
		return nil, errnoOf(err)
	}
	start := off &^ (directAlign - 1)
	end := (off + uint64(n) + directAlign - 1) &^ (directAlign - 1)
	buf := alignedBuf(int(end - start))
	if err := preadFull(r.head, buf, int64(start)); err != nil {
		return nil, errnoOf(err)
	}
	return buf[off-start : off-start+uint64(n)], 0
}

// write is one O_DIRECT pwrite64 of the data, then the 4 KiB revision.counter pwrite64.
func (r *replica) write(off uint64, data []byte) syscall.Errno {
	if off%directAlign == 0 && len(data)%directAlign == 0 {
		r.rmw.RLock()
		err := pwriteFull(r.head, data, int64(off))
		r.rmw.RUnlock()
		if err != nil {
			return errnoOf(err)
		}
	} else {
		// A partial 4 KiB block (512-byte sector writes): O_DIRECT cannot write it as is.
		r.rmw.Lock()
		start := off &^ (directAlign - 1)
		end := (off + uint64(len(data)) + directAlign - 1) &^ (directAlign - 1)
		buf := alignedBuf(int(end - start))
		err := preadFull(r.head, buf, int64(start))
		if err == nil {
			copy(buf[off-start:], data)
			err = pwriteFull(r.head, buf, int64(start))
		}
		r.rmw.Unlock()
		if err != nil {
			return errnoOf(err)
		}
	}
	r.revision.Add(1)
	return errnoOf(r.writeRevision())
}

func (r *replica) writeRevision() error {
	buf := alignedBuf(directAlign)
	copy(buf, strconv.FormatUint(r.revision.Load(), 10))
	return pwriteFull(r.revFd, buf, 0)
}

// alignedBuf returns n bytes starting at a directAlign boundary, as O_DIRECT requires of
// user buffers.
func alignedBuf(n int) []byte {
	raw := make([]byte, n+directAlign)
	skip := int(-uintptr(unsafe.Pointer(&raw[0])) & (directAlign - 1))
	return raw[skip : skip+n : skip+n]
}

func preadFull(fd int, buf []byte, off int64) error {
	for len(buf) > 0 {
		n, err := unix.Pread(fd, buf, off)
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			return err
		}
		if n == 0 {
			return syscall.EIO // beyond the end of a file that was sized at start
		}
		buf, off = buf[n:], off+int64(n)
	}
	return nil
}

func pwriteFull(fd int, buf []byte, off int64) error {
	for len(buf) > 0 {
		n, err := unix.Pwrite(fd, buf, off)
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			return err
		}
		buf, off = buf[n:], off+int64(n)
	}
	return nil
}

func errnoOf(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		return e
	}
	return syscall.EIO
}
