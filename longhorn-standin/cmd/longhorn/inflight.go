package main

import "sync/atomic"

// inflight counts the requests a process is serving and remembers the most it has served at
// once, so a test can tell concurrent requests from lock-step ones at every hop (engine:
// frontend requests; replica: requests from the engine, until the reply is sent).
type inflight struct {
	cur, max atomic.Int64
}

func (g *inflight) enter() {
	n := g.cur.Add(1)
	for {
		m := g.max.Load()
		if n <= m || g.max.CompareAndSwap(m, n) {
			return
		}
	}
}

func (g *inflight) leave() { g.cur.Add(-1) }
