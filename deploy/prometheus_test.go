package deploy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/internal/freeport"
)

// promAPI is the envelope of Prometheus's HTTP API answers.
type promAPI struct {
	Status    string          `json:"status"`
	ErrorType string          `json:"errorType"`
	Error     string          `json:"error"`
	Data      json.RawMessage `json:"data"`
}

func promGet(ctx context.Context, base, path string, q url.Values) (json.RawMessage, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+path+"?"+q.Encode(), nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var a promAPI
	if err := json.NewDecoder(resp.Body).Decode(&a); err != nil {
		return nil, fmt.Errorf("%s: %s: %w", path, resp.Status, err)
	}
	if a.Status != "success" {
		return nil, fmt.Errorf("%s %v: %s: %s", path, q, a.ErrorType, a.Error)
	}
	return a.Data, nil
}

// vectorResult is an instant query's answer.
type vectorResult struct {
	ResultType string `json:"resultType"`
	Result     []struct {
		Metric map[string]string `json:"metric"`
		Value  [2]any            `json:"value"`
	} `json:"result"`
}

func promQuery(ctx context.Context, base, expr string) (vectorResult, error) {
	var v vectorResult
	data, err := promGet(ctx, base, "/api/v1/query", url.Values{"query": {expr}})
	if err != nil {
		return v, err
	}
	return v, json.Unmarshal(data, &v)
}

// grafanaToPromQL replaces the dashboard's variables by what Grafana would
// send: every model, gateway and replica, the default 2 s SLO, a 30 s rate
// window (the test scrapes every second).
func grafanaToPromQL(expr string) string {
	return strings.NewReplacer("$__rate_interval", "30s", "$model", ".*", "$gateway", ".*",
		"$replica", ".*", "$slo", "2").Replace(expr)
}

var promReady = regexp.MustCompile(`(Server is ready to receive web requests)`)

// TestPrometheusAnswersDashboard runs Debian's Prometheus against a live
// gateway and simulated engines, loads rules.yaml, and asks it every
// dashboard query: each must succeed with data, and every rule must
// evaluate without error and, for recording rules, produce series.
// KVMESH_DEPLOY_PROMETHEUS=1 enables it (apt-get install prometheus).
func TestPrometheusAnswersDashboard(t *testing.T) {
	if os.Getenv("KVMESH_DEPLOY_PROMETHEUS") != "1" {
		t.Skip("set KVMESH_DEPLOY_PROMETHEUS=1 to run a real Prometheus (Debian package prometheus)")
	}
	promBin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatalf("KVMESH_DEPLOY_PROMETHEUS=1 but no prometheus binary: %v", err)
	}
	want := queriedMetrics(t)
	s := startMetricsStack(t)
	s.drive(t, want, 300)

	rules, err := filepath.Abs("prometheus/rules.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var cfg strings.Builder
	fmt.Fprintf(&cfg, "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - %s\nscrape_configs:\n", rules)
	fmt.Fprintf(&cfg, "  - job_name: kvmesh\n    static_configs:\n      - targets: [\"%s\"]\n", strings.Join(s.gateways, `", "`))
	fmt.Fprintf(&cfg, "  - job_name: vllm\n    static_configs:\n")
	for _, e := range s.engines {
		fmt.Fprintf(&cfg, "      - targets: [%q]\n        labels:\n          replica: %s\n", e.addr, e.name)
	}
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	listen := fmt.Sprintf("127.0.0.1:%d", freeport.Ports(t, 1)[0])
	startProc(t, "prometheus", promBin, []string{
		"--config.file=" + cfgPath, "--storage.tsdb.path=" + filepath.Join(dir, "data"),
		"--web.listen-address=" + listen, "--log.level=info",
	}, promReady)
	base := "http://" + listen

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	targets := len(s.gateways) + len(s.engines)
	require.Eventually(t, func() bool {
		v, err := promQuery(ctx, base, "count(up == 1)")
		return err == nil && len(v.Result) == 1 && v.Result[0].Value[1] == fmt.Sprint(targets)
	}, 30*time.Second, 200*time.Millisecond, "Prometheus never saw all %d targets up", targets)

	// Traffic while Prometheus scrapes, so that rates have samples.
	deadline := time.Now().Add(8 * time.Second)
	for i := 0; i < 2000 && time.Now().Before(deadline); i++ {
		gw := s.gateways[i%len(s.gateways)]
		if code, _, err := complete(ctx, gw, liveModel, strategies[(i/len(s.gateways))%len(strategies)], prompt(i%4, 1000+i), 4); err != nil || code != http.StatusOK {
			t.Fatalf("request %d: status %d, %v", i, code, err)
		}
	}

	exprs, _ := dashboardQueries(t)
	keys := make([]string, 0, len(exprs))
	for k := range exprs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		q := grafanaToPromQL(exprs[k])
		v, err := promQuery(ctx, base, q)
		switch {
		case err != nil:
			t.Errorf("%s: %v", k, err)
		case len(v.Result) == 0:
			t.Errorf("%s: no data for %s", k, q)
		default:
			t.Logf("%s: %d series, e.g. %v = %v", k, len(v.Result), v.Result[0].Metric, v.Result[0].Value[1])
		}
	}

	// Every rule evaluated, without error; recording rules produce series.
	type ruleState struct {
		Name           string    `json:"name"`
		Type           string    `json:"type"`
		Health         string    `json:"health"`
		LastError      string    `json:"lastError"`
		LastEvaluation time.Time `json:"lastEvaluation"`
	}
	var states []ruleState
	require.Eventually(t, func() bool {
		data, err := promGet(ctx, base, "/api/v1/rules", url.Values{})
		if err != nil {
			return false
		}
		var r struct {
			Groups []struct {
				Rules []ruleState `json:"rules"`
			} `json:"groups"`
		}
		if json.Unmarshal(data, &r) != nil {
			return false
		}
		states = states[:0]
		for _, g := range r.Groups {
			states = append(states, g.Rules...)
		}
		for _, st := range states {
			if st.Health == "unknown" || st.LastEvaluation.Before(deadline) {
				return false
			}
		}
		return len(states) == len(readRules(t))
	}, 30*time.Second, 200*time.Millisecond, "rules not all evaluated after the traffic")
	for _, st := range states {
		if st.Health != "ok" {
			t.Errorf("rule %s: health %s: %s", st.Name, st.Health, st.LastError)
		}
		if st.Type != "recording" {
			continue
		}
		v, err := promQuery(ctx, base, st.Name)
		if err != nil || len(v.Result) == 0 {
			t.Errorf("recording rule %s: no series (err %v)", st.Name, err)
		}
	}
	t.Logf("%d dashboard queries and %d rules answered by %s", len(keys), len(states), promBin)
}
