package main

import (
	"flag"
	"slices"
	"testing"
)

// The argv shapes of DESIGN.md §5 must parse: positionals may sit between flags.
func TestParseInterleavedTakesRealArgvShapes(t *testing.T) {
	cases := []struct {
		args []string
		pos  []string
		vol  string
	}{
		{[]string{"pvc-1", "--frontend", "socket", "--replica", "tcp://a:1", "--listen", ":9501"}, []string{"pvc-1"}, ""},
		{[]string{"/r/pvc-1-0123abcd", "--volume-name", "pvc-1", "--size", "4096"}, []string{"/r/pvc-1-0123abcd"}, "pvc-1"},
		{[]string{"--size", "4096", "/r/pvc-1-0123abcd", "--upgrade"}, []string{"/r/pvc-1-0123abcd"}, ""},
	}
	for _, c := range cases {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		vol := fs.String("volume-name", "", "")
		var replicas listFlag
		fs.Var(&replicas, "replica", "")
		ignoreFlags(fs, []string{"frontend", "listen", "size"}, []string{"upgrade"})
		pos, err := parseInterleaved(fs, c.args)
		if err != nil {
			t.Fatalf("%q: %v", c.args, err)
		}
		if !slices.Equal(pos, c.pos) || *vol != c.vol {
			t.Errorf("%q: positionals %q volume %q, want %q %q", c.args, pos, *vol, c.pos, c.vol)
		}
	}
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	if _, err := parseInterleaved(fs, []string{"x", "--no-such-flag"}); err == nil {
		t.Error("unknown flag accepted")
	}
}
