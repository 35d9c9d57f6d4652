// Go 1.25+ re-reads the cgroup CPU limit every second with pread64; real Longhorn builds do
// not, and pgio would count those reads as the process's own IO syscalls.
//go:debug updatemaxprocs=0

// Command longhorn-fuse exposes a stand-in Longhorn volume as one file in a FUSE mount, so
// `losetup --direct-io=on` can turn it into a block device. It plays the part tgtd plays in
// real Longhorn v1 (block requests in, engine socket requests out) on hosts without iSCSI, and
// is a separate executable so its comm is not "longhorn".
//
//	longhorn-fuse --socket /path/longhorn-<vol>.sock --size <bytes> [--volume <vol>] <mountpoint>
//
// The mountpoint holds one file named after the volume. Every open is FOPEN_DIRECT_IO, so no
// page cache sits between the loop device and the engine: one loop request is one FUSE
// request is one engine request (up to --max-io bytes, 1 MiB by default). The mount
// negotiates async direct IO and serves requests in parallel over the one (multiplexed)
// engine connection, so the loop device's queue depth reaches the engine, as tgtd's does.
// Prints "READY fuse <file>" once mounted; SIGTERM/SIGINT unmount and exit. Mounts with
// mount(2) directly (needs root; there is no fusermount here).
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"pgio/longhorn-standin/internal/wire"
)

// volumeFile is the one file; it forwards IO to the engine.
type volumeFile struct {
	fs.Inode
	size   uint64
	engine *wire.Client
}

var (
	_ fs.NodeOpener    = (*volumeFile)(nil)
	_ fs.NodeGetattrer = (*volumeFile)(nil)
	_ fs.NodeSetattrer = (*volumeFile)(nil)
	_ fs.NodeReader    = (*volumeFile)(nil)
	_ fs.NodeWriter    = (*volumeFile)(nil)
	_ fs.NodeFsyncer   = (*volumeFile)(nil)
	_ fs.NodeFlusher   = (*volumeFile)(nil)
	_ fs.NodeAllocater = (*volumeFile)(nil)
)

func (f *volumeFile) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	// DIRECT_IO: the kernel sends every read/write to us instead of caching pages, so the
	// engine and replicas see the loop device's requests one for one. PARALLEL_DIRECT_WRITES:
	// without it the kernel serializes writes to the file, unlike a real block device.
	return nil, fuse.FOPEN_DIRECT_IO | fuse.FOPEN_PARALLEL_DIRECT_WRITES, 0
}

func (f *volumeFile) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o600
	out.Size = f.size
	out.Blocks = (f.size + 511) / 512
	out.Blksize = 4096
	out.Nlink = 1
	return 0
}

// Setattr accepts mode/time changes silently (nothing to store) but refuses resizing: the
// volume size is fixed, as a block device's is.
func (f *volumeFile) Setattr(ctx context.Context, fh fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if sz, ok := in.GetSize(); ok && sz != f.size {
		return syscall.EPERM
	}
	return f.Getattr(ctx, fh, out)
}

func (f *volumeFile) clamp(off int64, n int) int {
	if off < 0 || uint64(off) >= f.size {
		return 0
	}
	return int(min(uint64(n), f.size-uint64(off)))
}

func (f *volumeFile) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n := f.clamp(off, len(dest))
	if n == 0 {
		return fuse.ReadResultData(nil), 0
	}
	got, err := f.engine.Do(wire.OpRead, uint64(off), uint32(n), nil, dest[:n])
	if err != nil {
		return nil, errnoOf(err)
	}
	return fuse.ReadResultData(dest[:got]), 0
}

func (f *volumeFile) Write(ctx context.Context, fh fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	n := f.clamp(off, len(data))
	if n < len(data) {
		return 0, syscall.ENOSPC
	}
	if _, err := f.engine.Do(wire.OpWrite, uint64(off), uint32(n), data, nil); err != nil {
		return 0, errnoOf(err)
	}
	return uint32(n), 0
}

func (f *volumeFile) Fsync(ctx context.Context, fh fs.FileHandle, flags uint32) syscall.Errno {
	_, err := f.engine.Do(wire.OpFlush, 0, 0, nil, nil)
	return errnoOf(err)
}

// Flush is close(2), not fsync: nothing to do.
func (f *volumeFile) Flush(ctx context.Context, fh fs.FileHandle) syscall.Errno { return 0 }

// Allocate serves the loop device's discard and write-zeroes (fallocate punch-hole /
// zero-range with KEEP_SIZE) as an engine unmap; a hole reads as zeroes, which is both.
func (f *volumeFile) Allocate(ctx context.Context, fh fs.FileHandle, off uint64, size uint64, mode uint32) syscall.Errno {
	const keepSize, punchHole, zeroRange = 0x01, 0x02, 0x10
	if mode&keepSize == 0 || mode&^(keepSize|punchHole|zeroRange) != 0 || mode&(punchHole|zeroRange) == 0 {
		return syscall.EOPNOTSUPP
	}
	if off+size > f.size {
		return syscall.EINVAL
	}
	// The wire length is 32 bits: split whole-device discards.
	const chunk = 1 << 30
	for size > 0 {
		n := min(size, chunk)
		if _, err := f.engine.Do(wire.OpUnmap, off, uint32(n), nil, nil); err != nil {
			return errnoOf(err)
		}
		off, size = off+n, size-n
	}
	return 0
}

func errnoOf(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	if e, ok := err.(syscall.Errno); ok {
		return e
	}
	return syscall.EIO
}

func main() {
	socket := flag.String("socket", "", "engine frontend unix socket")
	size := flag.Uint64("size", 0, "volume size in bytes")
	volume := flag.String("volume", "", "file name in the mount (default: the socket's volume name)")
	maxIO := flag.Int("max-io", 1<<20, "largest FUSE read/write request in bytes")
	debug := flag.Bool("debug", false, "log every FUSE request")
	flag.Parse()
	if flag.NArg() != 1 || *socket == "" || *size == 0 {
		fmt.Fprintln(os.Stderr, "usage: longhorn-fuse --socket PATH --size BYTES [--volume NAME] MOUNTPOINT")
		os.Exit(2)
	}
	mnt := flag.Arg(0)
	if *volume == "" {
		*volume = strings.TrimSuffix(strings.TrimPrefix(filepath.Base(*socket), "longhorn-"), ".sock")
	}
	conn, err := net.Dial("unix", *socket)
	if err != nil {
		fatal(err)
	}
	engine := wire.NewClient(conn)

	root := &fs.Inode{}
	file := &volumeFile{size: *size, engine: engine}
	attrTimeout := time.Hour // the size never changes
	server, err := fs.Mount(mnt, root, &fs.Options{
		AttrTimeout:  &attrTimeout,
		EntryTimeout: &attrTimeout,
		MountOptions: fuse.MountOptions{
			DirectMountStrict: true, // no fusermount binary: mount(2) as root
			AllowOther:        true,
			FsName:            "longhorn-" + *volume,
			Name:              "longhorn",
			MaxWrite:          *maxIO,
			// The loop device submits its direct IO as async kiocbs. Without ASYNC_DIO the
			// kernel turns each into a synchronous FUSE request, so the loop worker waits for
			// one request to finish before it submits the next: one engine request in flight
			// however deep the device queue. With it, they go out as background requests,
			// up to MaxBackground at once, as tgtd keeps many engine requests in flight.
			ExtraCapabilities: fuse.CAP_ASYNC_DIO,
			MaxBackground:     128,
			DisableXAttrs:     true,
			Debug:             *debug,
		},
		OnAdd: func(ctx context.Context) {
			root.AddChild(*volume, root.NewPersistentInode(ctx, file, fs.StableAttr{Mode: syscall.S_IFREG, Ino: 2}), false)
		},
	})
	if err != nil {
		fatal(err)
	}
	if server.KernelSettings().Flags64()&fuse.CAP_ASYNC_DIO == 0 {
		fmt.Fprintln(os.Stderr, "longhorn-fuse: kernel does not offer FUSE_ASYNC_DIO: "+
			"the loop device will send one request at a time")
	}
	fmt.Printf("READY fuse %s\n", filepath.Join(mnt, *volume))

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		s := <-sig
		fmt.Fprintf(os.Stderr, "longhorn-fuse: %v, unmounting %s\n", s, mnt)
		// EBUSY while a loop device still holds the file: go-fuse retries briefly; after that
		// exit non-zero and leave the lazy unmount to whoever started us.
		if err := server.Unmount(); err != nil {
			fmt.Fprintf(os.Stderr, "longhorn-fuse: unmount: %v\n", err)
			os.Exit(1)
		}
	}()
	server.Wait()
	engine.Close()
}

func fatal(err error) {
	fmt.Fprintf(os.Stderr, "longhorn-fuse: %v\n", err)
	os.Exit(1)
}
