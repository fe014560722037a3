package deploy_test

import (
	"bytes"
	"flag"
	"os"
	"reflect"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

var update = flag.Bool("update", false, "rewrite kubernetes/base/prometheusrule.yaml from prometheus/rules.yaml")

const prometheusRulePath = "kubernetes/base/prometheusrule.yaml"

// renderPrometheusRule wraps rules.yaml's groups in a Prometheus Operator
// PrometheusRule object.
func renderPrometheusRule(t *testing.T) []byte {
	t.Helper()
	rules, err := os.ReadFile("prometheus/rules.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	b.WriteString(`# Generated from deploy/prometheus/rules.yaml by
#   go test ./deploy -run TestPrometheusRuleMatchesRules -update
# Do not edit: edit rules.yaml and regenerate.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kvmesh
  labels:
    app.kubernetes.io/name: kvmesh
    app.kubernetes.io/component: gateway
spec:
`)
	// rules.yaml's leading comment stays there; the rest moves under spec.
	body := string(rules)
	if i := strings.Index(body, "\ngroups:"); i >= 0 {
		body = body[i+1:]
	}
	for line := range strings.Lines(body) {
		if strings.TrimSpace(line) == "" {
			b.WriteString("\n")
			continue
		}
		b.WriteString("  " + line)
	}
	return b.Bytes()
}

// TestPrometheusRuleMatchesRules keeps the operator's PrometheusRule equal
// to rules.yaml, which promtool and Prometheus test.
func TestPrometheusRuleMatchesRules(t *testing.T) {
	want := renderPrometheusRule(t)
	if *update {
		if err := os.WriteFile(prometheusRulePath, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(prometheusRulePath)
	if err != nil {
		t.Fatal(err)
	}
	var gotDoc, rulesDoc struct {
		Spec   map[string]any `yaml:"spec"`
		Groups []any          `yaml:"groups"`
	}
	if err := yaml.Unmarshal(got, &gotDoc); err != nil {
		t.Fatalf("%s: %v", prometheusRulePath, err)
	}
	rules, _ := os.ReadFile("prometheus/rules.yaml")
	if err := yaml.Unmarshal(rules, &rulesDoc); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(gotDoc.Spec["groups"], rulesDoc.Groups) || len(rulesDoc.Groups) == 0 {
		t.Fatalf("%s is out of date with prometheus/rules.yaml: go test ./deploy -run TestPrometheusRuleMatchesRules -update", prometheusRulePath)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s is not the rendering of rules.yaml: go test ./deploy -run TestPrometheusRuleMatchesRules -update", prometheusRulePath)
	}
}
