package main

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"pgio/longhorn-standin/internal/wire"
)

// connsPerReplica matches the real engine's data connections per replica.
const connsPerReplica = 2

type replicaConns struct {
	addr  string
	conns [connsPerReplica]*wire.Client
	next  atomic.Uint32
}

func (rc *replicaConns) pick() *wire.Client {
	return rc.conns[rc.next.Add(1)%connsPerReplica]
}

type controller struct {
	size     uint64
	replicas []*replicaConns
	next     atomic.Uint32

	reads, writes, flushes, unmaps atomic.Uint64
	inflight                       inflight // frontend requests being served
}

func runController(g globals, args []string) error {
	fs := flag.NewFlagSet("controller", flag.ContinueOnError)
	frontend := fs.String("frontend", "socket", "frontend; every value serves the unix socket")
	size := fs.Uint64("size", 0, "volume size in bytes")
	listen := fs.String("listen", "", "control address [HOST]:PORT (serves stats)")
	socketPath := fs.String("frontend-socket", "", "frontend unix socket (default /var/run/longhorn-<volume>.sock)")
	var replicas listFlag
	fs.Var(&replicas, "replica", "replica address tcp://HOST:PORT (repeat)")
	ignoreFlags(fs,
		[]string{"current-size", "snapshot-max-count", "snapshot-max-size", "engine-replica-timeout",
			"file-sync-http-client-timeout", "data-server-protocol", "engine-instance-name"},
		[]string{"upgrade", "disableRevCounter", "salvageRequested", "unmap-mark-snap-chain-removed"})
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("want exactly one volume name, got %q", pos)
	}
	volume := pos[0]
	if *size == 0 || len(replicas) == 0 || *listen == "" {
		return errors.New("--size, --listen and at least one --replica are required")
	}
	if *socketPath == "" {
		*socketPath = "/var/run/longhorn-" + volume + ".sock"
	}
	c := &controller{size: *size}
	for _, u := range replicas {
		rc, err := connectReplica(u)
		if err != nil {
			return err
		}
		c.replicas = append(c.replicas, rc)
	}

	_ = os.Remove(*socketPath) // a stale socket from a killed engine
	sock, err := net.Listen("unix", *socketPath)
	if err != nil {
		return err
	}
	defer os.Remove(*socketPath)
	ctl, err := net.Listen("tcp", normalizeListen(*listen))
	if err != nil {
		return err
	}
	logf("controller %s (instance %q, frontend %s) size %d replicas %v socket %s listen %s",
		volume, g.engineInstance, *frontend, *size, replicas, *socketPath, ctl.Addr())
	plain := func(n int) []byte { return make([]byte, n) }
	go acceptLoop(sock, plain, c.handle)
	go acceptLoop(ctl, plain, c.handle)
	ready("controller", *socketPath)
	logf("controller: %v, exiting", waitForSignal())
	return nil
}

// connectReplica opens the data connections, retrying for a while: the replica may still
// be starting (the real engine waits for replicas the same way).
func connectReplica(url string) (*replicaConns, error) {
	addr, ok := strings.CutPrefix(url, "tcp://")
	if !ok {
		return nil, fmt.Errorf("replica %q: want tcp://HOST:PORT", url)
	}
	rc := &replicaConns{addr: addr}
	deadline := time.Now().Add(30 * time.Second)
	for i := range rc.conns {
		for {
			conn, err := net.Dial("tcp", addr)
			if err == nil {
				_ = conn.(*net.TCPConn).SetNoDelay(true)
				rc.conns[i] = wire.NewClient(conn)
				break
			}
			if time.Now().After(deadline) {
				return nil, fmt.Errorf("replica %s: %w", addr, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return rc, nil
}

// handle runs in its own goroutine per frontend request (wire.Serve).
func (c *controller) handle(req *wire.Request) ([]byte, syscall.Errno) {
	if req.Op == wire.OpStats {
		return []byte(fmt.Sprintf("reads=%d writes=%d flushes=%d unmaps=%d inflight=%d max_inflight=%d\n",
			c.reads.Load(), c.writes.Load(), c.flushes.Load(), c.unmaps.Load(),
			c.inflight.cur.Load(), c.inflight.max.Load())), 0
	}
	c.inflight.enter()
	defer c.inflight.leave()
	if req.Op == wire.OpFlush {
		// Longhorn's data connection has no sync message: replica writes are O_DIRECT and
		// acknowledged, so a frontend flush completes at the engine.
		c.flushes.Add(1)
		return nil, 0
	}
	if req.Offset+uint64(req.Length) > c.size {
		return nil, syscall.EINVAL
	}
	switch req.Op {
	case wire.OpRead:
		c.reads.Add(1)
		// One replica per read, round-robin over replicas and their connections.
		rc := c.replicas[c.next.Add(1)%uint32(len(c.replicas))]
		buf := make([]byte, req.Length)
		n, err := rc.pick().Do(wire.OpRead, req.Offset, req.Length, nil, buf)
		if err != nil {
			logf("read from %s: %v", rc.addr, err)
			return nil, toErrno(err)
		}
		return buf[:n], 0
	case wire.OpWrite:
		c.writes.Add(1)
		return nil, c.toAll(wire.OpWrite, req)
	case wire.OpUnmap:
		c.unmaps.Add(1)
		return nil, c.toAll(wire.OpUnmap, req)
	}
	return nil, syscall.EOPNOTSUPP
}

// toAll sends a mutation to every replica in parallel; it completes when all acked.
func (c *controller) toAll(op uint8, req *wire.Request) syscall.Errno {
	errs := make([]error, len(c.replicas))
	var wg sync.WaitGroup
	for i, rc := range c.replicas {
		wg.Go(func() {
			_, errs[i] = rc.pick().Do(op, req.Offset, req.Length, req.Data, nil)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			logf("op %d to %s: %v", op, c.replicas[i].addr, err)
			return toErrno(err)
		}
	}
	return 0
}

func toErrno(err error) syscall.Errno {
	var e syscall.Errno
	if errors.As(err, &e) {
		return e
	}
	return syscall.EIO
}
