// Go 1.25+ re-reads the cgroup CPU limit every second with pread64; real Longhorn builds do
// not, and pgio would count those reads as the process's own IO syscalls.
//go:debug updatemaxprocs=0

// Command longhorn is a stand-in for the Longhorn v1 engine binary, for pgio's tests: the real
// one cannot be installed from the registries we can reach. It keeps what pgio observes:
// the executable name (comm "longhorn" on every thread), the argv shapes of the three
// per-volume processes, and their IO pattern (goroutine per request, 2 TCP connections per
// replica, replica reads as fstat + O_DIRECT pread64 on volume-head-000.img, writes as data
// pwrite64 + 4 KiB revision.counter pwrite64). Snapshots, rebuilds, gRPC control, and
// failover are not modelled.
//
//	longhorn [global flags] controller <volume> --frontend socket --size <bytes>
//	    --replica tcp://HOST:PORT [--replica ...] --listen [HOST]:PORT [--frontend-socket PATH]
//	longhorn [global flags] replica <dir> --size <bytes> --listen HOST:PORT
//	    [--replica-instance-name NAME] [--volume-name VOL] [--inject-latency DUR]
//	longhorn [global flags] sync-agent --listen HOST:PORT
//
// Global flags (before the subcommand): --volume-name, --engine-instance-name, --url,
// --debug. Our own --inject-latency DUR (replica only: sleep DUR after each request's IO,
// before replying) is accepted there too, but put it after `replica`: a classifier that
// skips only the real global flags would otherwise take its value for the subcommand.
// Flags the real binary takes that do not matter here are accepted and ignored; unknown
// flags are an error.
//
// Each process prints one line "READY <role> <address>" on stdout once it serves, then logs to
// stderr only; SIGTERM/SIGINT end it with status 0.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

// globals are the flags before the subcommand (urfave/cli "global flags" in the real binary).
type globals struct {
	volumeName     string
	engineInstance string
	injectLatency  time.Duration
}

func main() {
	gfs := flag.NewFlagSet("longhorn", flag.ContinueOnError)
	var g globals
	gfs.StringVar(&g.volumeName, "volume-name", "", "volume name")
	gfs.StringVar(&g.engineInstance, "engine-instance-name", "", "engine instance name")
	gfs.String("url", "", "ignored (real: control address)")
	gfs.Bool("debug", false, "ignored")
	gfs.DurationVar(&g.injectLatency, "inject-latency", 0, "replica: sleep this long per request before replying")
	if err := gfs.Parse(os.Args[1:]); err != nil {
		os.Exit(2)
	}
	if gfs.NArg() == 0 {
		fatalf("missing subcommand (controller, replica or sync-agent)")
	}
	sub, args := gfs.Arg(0), gfs.Args()[1:]
	var err error
	switch sub {
	case "controller":
		err = runController(g, args)
	case "replica":
		err = runReplica(g, args)
	case "sync-agent":
		err = runSyncAgent(g, args)
	default:
		fatalf("unknown subcommand %q", sub)
	}
	if err != nil {
		fatalf("%s: %v", sub, err)
	}
}

func fatalf(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "longhorn: "+format+"\n", a...)
	os.Exit(1)
}

func logf(format string, a ...any) {
	fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05.000 ")+format+"\n", a...)
}

// parseInterleaved parses flags and positional arguments in any order (urfave/cli allows
// `controller <vol> --size ...`; Go's flag package stops at the first positional).
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	fs.SetOutput(io.Discard)
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

// ignoreFlags declares flags the real binary takes that do not matter here, so real argv
// lines parse unchanged.
func ignoreFlags(fs *flag.FlagSet, withValue []string, boolean []string) {
	for _, n := range withValue {
		fs.String(n, "", "ignored")
	}
	for _, n := range boolean {
		fs.Bool(n, false, "ignored")
	}
}

// listFlag is a repeatable string flag (--replica a --replica b).
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// ready tells the parent (the test fixture) that we serve: it waits for this line instead
// of polling ports.
func ready(role, addr string) {
	fmt.Fprintf(os.Stdout, "READY %s %s\n", role, addr)
}

// waitForSignal blocks until SIGTERM or SIGINT.
func waitForSignal() os.Signal {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT)
	return <-ch
}

// normalizeListen turns ":PORT" (v1.10+ argv) into an address net.Listen takes as is; both
// forms already work, this only makes the READY line show a concrete host.
func normalizeListen(addr string) string {
	if strings.HasPrefix(addr, ":") {
		return "0.0.0.0" + addr
	}
	return addr
}
