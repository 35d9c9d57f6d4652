package main

import (
	"errors"
	"flag"
	"io"
	"net"
)

// runSyncAgent only listens: the real sync-agent serves snapshot/backup file transfers, none
// of which the tests exercise. It exists so a third per-volume `longhorn` process with its
// argv shape is there to classify.
func runSyncAgent(g globals, args []string) error {
	fs := flag.NewFlagSet("sync-agent", flag.ContinueOnError)
	listen := fs.String("listen", "", "address HOST:PORT")
	ignoreFlags(fs, []string{"listen-port-range", "replica", "volume-name"}, nil)
	if _, err := parseInterleaved(fs, args); err != nil {
		return err
	}
	if *listen == "" {
		return errors.New("--listen is required")
	}
	l, err := net.Listen("tcp", normalizeListen(*listen))
	if err != nil {
		return err
	}
	logf("sync-agent (volume %q) listening on %s", g.volumeName, l.Addr())
	go func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				_, _ = io.Copy(io.Discard, conn)
			}()
		}
	}()
	ready("sync-agent", l.Addr().String())
	logf("sync-agent: %v, exiting", waitForSignal())
	return nil
}
