// Package wire is the stand-in's one framing protocol, spoken on the engine's frontend unix
// socket, on its --listen port and between engine and replicas over TCP.
//
// Real Longhorn uses its own "dataconn" framing between engine and replica and a similar one
// between tgtd and the engine socket. We do not need compatibility with either, only the same
// shape: every request carries an id so many can be in flight on one connection and
// responses may come back in any order.
//
// Request:  op u8, 3 zero bytes, length u32, id u64, offset u64 (24 bytes, little-endian),
//
//	then `length` bytes of data for OpWrite.
//
// Response: id u64, errno u32, length u32 (16 bytes), then `length` bytes of data
//
//	(read data, or the stats text).
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
)

// Operations. Flush exists on the frontend protocol only: like Longhorn's dataconn, the
// engine never forwards it, since replicas write with O_DIRECT.
const (
	OpRead  uint8 = 1
	OpWrite uint8 = 2
	OpFlush uint8 = 3
	OpUnmap uint8 = 4 // discard: punch a hole (offset, length); no data follows
	OpStats uint8 = 5 // response data is one text line of key=value counters
)

const (
	ReqHeaderLen  = 24
	RespHeaderLen = 16
	// MaxLength bounds reads and writes so a corrupt header cannot make us allocate
	// gigabytes (unmaps carry no data and may be longer).
	MaxLength = 16 << 20
)

// Request is one decoded request. Data is the write payload (nil otherwise).
type Request struct {
	Op     uint8
	Length uint32
	ID     uint64
	Offset uint64
	Data   []byte
}

// Handler serves one request in its own goroutine and returns the response data (read data
// or stats) or an errno.
type Handler func(req *Request) ([]byte, syscall.Errno)

// Serve reads requests from conn until it fails and runs each in a new goroutine, the way the
// real engine and replica do (a slow request must not hold up the ones behind it). alloc
// provides the buffer a write payload is read into, so the replica can hand out
// O_DIRECT-aligned memory and write it without a copy.
func Serve(conn net.Conn, alloc func(n int) []byte, h Handler) error {
	defer conn.Close()
	var wmu sync.Mutex
	hdr := make([]byte, ReqHeaderLen)
	for {
		if _, err := io.ReadFull(conn, hdr); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		req := &Request{
			Op:     hdr[0],
			Length: binary.LittleEndian.Uint32(hdr[4:]),
			ID:     binary.LittleEndian.Uint64(hdr[8:]),
			Offset: binary.LittleEndian.Uint64(hdr[16:]),
		}
		if req.Length > MaxLength && (req.Op == OpRead || req.Op == OpWrite) {
			return fmt.Errorf("request %d: length %d over limit", req.ID, req.Length)
		}
		if req.Op == OpWrite {
			req.Data = alloc(int(req.Length))
			if _, err := io.ReadFull(conn, req.Data); err != nil {
				return err
			}
		}
		go func() {
			data, errno := h(req)
			resp := make([]byte, RespHeaderLen, RespHeaderLen+len(data))
			binary.LittleEndian.PutUint64(resp[0:], req.ID)
			binary.LittleEndian.PutUint32(resp[8:], uint32(errno))
			binary.LittleEndian.PutUint32(resp[12:], uint32(len(data)))
			wmu.Lock()
			defer wmu.Unlock()
			// One write per response keeps header and data together; net.Buffers becomes
			// writev, so read data is not copied again.
			bufs := net.Buffers{resp, data}
			if _, err := bufs.WriteTo(conn); err != nil {
				conn.Close() // the read loop sees the error and returns
			}
		}()
	}
}

// Client multiplexes requests over one connection; safe for concurrent use.
type Client struct {
	conn   net.Conn
	nextID atomic.Uint64
	wmu    sync.Mutex

	mu      sync.Mutex
	pending map[uint64]*call
	err     error // set once the connection failed; all later calls fail with it
}

type call struct {
	dst   []byte // read data lands here directly
	n     int
	errno syscall.Errno
	err   error
	done  chan struct{}
}

// NewClient starts the response reader for conn.
func NewClient(conn net.Conn) *Client {
	c := &Client{conn: conn, pending: map[uint64]*call{}}
	go c.readLoop()
	return c
}

// Dial connects (network "unix" or "tcp") and starts a client on the connection.
func Dial(network, addr string) (*Client, error) {
	conn, err := net.Dial(network, addr)
	if err != nil {
		return nil, err
	}
	return NewClient(conn), nil
}

// Close closes the connection; calls in flight fail.
func (c *Client) Close() error { return c.conn.Close() }

// Do sends one request and waits for its response. For OpRead and OpStats the response data
// is copied into dst (at most len(dst) bytes) and the count returned; for OpWrite `data` is
// sent. A non-zero errno from the peer comes back as that syscall.Errno.
func (c *Client) Do(op uint8, offset uint64, length uint32, data, dst []byte) (int, error) {
	cl := &call{dst: dst, done: make(chan struct{})}
	id := c.nextID.Add(1)
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return 0, err
	}
	c.pending[id] = cl
	c.mu.Unlock()

	hdr := make([]byte, ReqHeaderLen)
	hdr[0] = op
	binary.LittleEndian.PutUint32(hdr[4:], length)
	binary.LittleEndian.PutUint64(hdr[8:], id)
	binary.LittleEndian.PutUint64(hdr[16:], offset)
	bufs := net.Buffers{hdr}
	if op == OpWrite {
		bufs = append(bufs, data)
	}
	c.wmu.Lock()
	_, err := bufs.WriteTo(c.conn)
	c.wmu.Unlock()
	if err != nil {
		c.fail(err)
	}
	<-cl.done
	if cl.err != nil {
		return 0, cl.err
	}
	if cl.errno != 0 {
		return 0, cl.errno
	}
	return cl.n, nil
}

func (c *Client) readLoop() {
	hdr := make([]byte, RespHeaderLen)
	for {
		if _, err := io.ReadFull(c.conn, hdr); err != nil {
			c.fail(err)
			return
		}
		id := binary.LittleEndian.Uint64(hdr[0:])
		errno := syscall.Errno(binary.LittleEndian.Uint32(hdr[8:]))
		n := int(binary.LittleEndian.Uint32(hdr[12:]))
		c.mu.Lock()
		cl := c.pending[id]
		delete(c.pending, id)
		c.mu.Unlock()
		if cl == nil {
			c.fail(fmt.Errorf("response for unknown request id %d", id))
			return
		}
		// Read straight into the caller's buffer; discard what does not fit (cannot happen
		// with a well-behaved peer, which never returns more than was asked for).
		keep := min(n, len(cl.dst))
		if _, err := io.ReadFull(c.conn, cl.dst[:keep]); err != nil {
			cl.err = err
			close(cl.done)
			c.fail(err)
			return
		}
		if _, err := io.CopyN(io.Discard, c.conn, int64(n-keep)); err != nil {
			cl.err = err
			close(cl.done)
			c.fail(err)
			return
		}
		cl.n, cl.errno = keep, errno
		close(cl.done)
	}
}

// fail marks the client broken and completes every pending call with err.
func (c *Client) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = fmt.Errorf("connection to %s: %w", c.conn.RemoteAddr(), err)
		c.conn.Close()
	}
	for id, cl := range c.pending {
		cl.err = c.err
		close(cl.done)
		delete(c.pending, id)
	}
}
