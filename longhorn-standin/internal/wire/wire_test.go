package wire

import (
	"encoding/binary"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Responses come back out of order (later requests finish first) and must still reach the
// caller that asked, with its own data.
func TestClientMatchesOutOfOrderResponses(t *testing.T) {
	a, b := net.Pipe()
	go Serve(b, func(n int) []byte { return make([]byte, n) }, func(r *Request) ([]byte, syscall.Errno) {
		switch r.Op {
		case OpRead:
			time.Sleep(time.Duration(64-r.Offset) * 100 * time.Microsecond)
			out := make([]byte, r.Length)
			binary.LittleEndian.PutUint64(out, r.Offset)
			return out, 0
		case OpWrite:
			if binary.LittleEndian.Uint64(r.Data) != r.Offset {
				return nil, syscall.EIO
			}
			return nil, 0
		}
		return nil, syscall.EOPNOTSUPP
	})
	c := NewClient(a)
	defer c.Close()
	var wg sync.WaitGroup
	for off := range uint64(64) {
		wg.Go(func() {
			buf := make([]byte, 8)
			if n, err := c.Do(OpRead, off, 8, nil, buf); err != nil || n != 8 || binary.LittleEndian.Uint64(buf) != off {
				t.Errorf("read %d: n=%d err=%v got %d", off, n, err, binary.LittleEndian.Uint64(buf))
			}
			if _, err := c.Do(OpWrite, off, 8, buf, nil); err != nil {
				t.Errorf("write %d: %v", off, err)
			}
		})
	}
	wg.Wait()
	if _, err := c.Do(OpUnmap, 0, 0, nil, nil); err != syscall.EOPNOTSUPP {
		t.Errorf("unknown op: got %v, want EOPNOTSUPP", err)
	}
	b.Close()
	if _, err := c.Do(OpRead, 0, 8, nil, make([]byte, 8)); err == nil {
		t.Error("read on a closed connection succeeded")
	}
}
