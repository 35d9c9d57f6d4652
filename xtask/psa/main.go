// psa-check: the Pod Security admission rules (k8s.io/pod-security-admission, the library the
// API server's admission plugin runs) applied to the pod template of every DaemonSet in a YAML
// stream on stdin. `cargo xtask deploy-check` runs it on each render: pgio's pods must be
// admitted by a namespace enforcing "privileged" and refused, for the documented reasons, by
// one enforcing "baseline" or "restricted".
//
// Usage: psa-check <Kubernetes minor, e.g. v1.30, or latest> < render.yaml
// Prints one JSON object per DaemonSet: {"name", "levels": {"<level>": {"allowed",
// "forbidden": [{"reason", "detail"}]}}}.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
)

type forbidden struct {
	Reason string `json:"reason"`
	Detail string `json:"detail"`
}

type verdict struct {
	Allowed   bool        `json:"allowed"`
	Forbidden []forbidden `json:"forbidden"`
}

type report struct {
	Name   string             `json:"name"`
	Levels map[string]verdict `json:"levels"`
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "psa-check:", err)
		os.Exit(1)
	}
}

func run() error {
	if len(os.Args) != 2 {
		return errors.New("usage: psa-check <Kubernetes minor, e.g. v1.30, or latest> < render.yaml")
	}
	version, err := api.ParseVersion(os.Args[1])
	if err != nil {
		return fmt.Errorf("version %q: %w", os.Args[1], err)
	}
	evaluator, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		return err
	}
	dec := yaml.NewYAMLOrJSONDecoder(os.Stdin, 4096)
	out := json.NewEncoder(os.Stdout)
	found := 0
	for {
		var ds appsv1.DaemonSet
		if err := dec.Decode(&ds); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return err
		}
		if ds.Kind != "DaemonSet" {
			continue
		}
		found++
		r := report{Name: ds.Name, Levels: map[string]verdict{}}
		for _, level := range []api.Level{api.LevelPrivileged, api.LevelBaseline, api.LevelRestricted} {
			lv := api.LevelVersion{Level: level, Version: version}
			results := evaluator.EvaluatePod(lv, &ds.Spec.Template.ObjectMeta, &ds.Spec.Template.Spec)
			v := verdict{Allowed: true, Forbidden: []forbidden{}}
			for _, res := range results {
				if !res.Allowed {
					v.Allowed = false
					v.Forbidden = append(v.Forbidden, forbidden{res.ForbiddenReason, res.ForbiddenDetail})
				}
			}
			r.Levels[string(level)] = v
		}
		if err := out.Encode(r); err != nil {
			return err
		}
	}
	if found == 0 {
		return errors.New("no DaemonSet on stdin")
	}
	return nil
}
