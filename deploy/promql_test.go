package deploy_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

// errPromQL marks an expression metricNames cannot scan.
var errPromQL = errors.New("deploy: promql")

// promqlKeywords are identifiers that are never metric names: aggregation
// operators, binary operators, modifiers and literals. Functions need no
// list: an identifier followed by "(" is a call.
var promqlKeywords = map[string]bool{
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true,
	"stdvar": true, "count": true, "count_values": true, "bottomk": true, "topk": true,
	"quantile": true, "limitk": true, "limit_ratio": true,
	"and": true, "or": true, "unless": true, "atan2": true, "bool": true,
	"by": true, "without": true, "on": true, "ignoring": true,
	"group_left": true, "group_right": true, "offset": true,
	"inf": true, "nan": true, "start": true, "end": true,
}

// labelListKeywords are followed by a parenthesized list of label names.
var labelListKeywords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true,
	"group_left": true, "group_right": true,
}

// metricNames returns the metric names an expression selects, sorted and
// without duplicates: bare selectors (`foo`, `foo{a="b"}`, `foo[5m]`) and
// `{__name__="foo"}` matchers. It understands enough PromQL to skip label
// names (in matchers and in by/without/on/ignoring/group_left/group_right
// lists), function and aggregation names, string literals, durations,
// numbers, comments and Grafana variables ($x, ${x}, [[x]]).
func metricNames(expr string) ([]string, error) {
	var names []string
	s := expr
	i := 0
	depth := 0
	isIdentStart := func(c byte) bool { return c == '_' || c == ':' || ('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z') }
	isIdent := func(c byte) bool { return isIdentStart(c) || ('0' <= c && c <= '9') }
	skipSpace := func(j int) int {
		for j < len(s) && strings.ContainsRune(" \t\r\n", rune(s[j])) {
			j++
		}
		return j
	}
	// skipString returns the index after the literal starting at j.
	skipString := func(j int) (int, string, error) {
		q := s[j]
		var b strings.Builder
		for k := j + 1; k < len(s); k++ {
			c := s[k]
			if c == '\\' && q != '`' {
				if k+1 >= len(s) {
					break
				}
				b.WriteByte(s[k+1])
				k++
				continue
			}
			if c == q {
				return k + 1, b.String(), nil
			}
			b.WriteByte(c)
		}
		return 0, "", fmt.Errorf("%w: unterminated string at %d in %q", errPromQL, j, expr)
	}
	// skipGrafanaVar returns the index after $name, ${name} or ${name:fmt}.
	skipGrafanaVar := func(j int) int {
		j++
		if j < len(s) && s[j] == '{' {
			if k := strings.IndexByte(s[j:], '}'); k >= 0 {
				return j + k + 1
			}
			return len(s)
		}
		for j < len(s) && isIdent(s[j]) && s[j] != ':' {
			j++
		}
		return j
	}
	// matchers scans a {...} block starting at j and returns the index
	// after it, recording __name__="x" matchers.
	matchers := func(j int) (int, error) {
		j++
		for {
			j = skipSpace(j)
			if j >= len(s) {
				return 0, fmt.Errorf("%w: unterminated {} in %q", errPromQL, expr)
			}
			switch c := s[j]; {
			case c == '}':
				return j + 1, nil
			case c == ',':
				j++
			case c == '"' || c == '\'' || c == '`':
				// A quoted label name (UTF-8 names) or a bare quoted metric name.
				end, _, err := skipString(j)
				if err != nil {
					return 0, err
				}
				j = end
			case isIdentStart(c):
				k := j
				for k < len(s) && isIdent(s[k]) {
					k++
				}
				label := s[j:k]
				k = skipSpace(k)
				op := k
				for k < len(s) && strings.ContainsRune("=!~", rune(s[k])) {
					k++
				}
				if op == k {
					return 0, fmt.Errorf("%w: matcher %q without operator in %q", errPromQL, label, expr)
				}
				k = skipSpace(k)
				if k >= len(s) || !strings.ContainsRune("\"'`", rune(s[k])) {
					return 0, fmt.Errorf("%w: matcher %q without value in %q", errPromQL, label, expr)
				}
				end, val, err := skipString(k)
				if err != nil {
					return 0, err
				}
				if label == "__name__" && s[op:op+1] == "=" && s[op+1] != '~' {
					names = append(names, val)
				}
				j = end
			default:
				return 0, fmt.Errorf("%w: unexpected %q in matchers of %q", errPromQL, c, expr)
			}
		}
	}
	for i < len(s) {
		c := s[i]
		switch {
		case strings.ContainsRune(" \t\r\n,+-*/%^=!<>@", rune(c)):
			i++
		case c == '(':
			depth++
			i++
		case c == ')':
			depth--
			if depth < 0 {
				return nil, fmt.Errorf("%w: unbalanced ) in %q", errPromQL, expr)
			}
			i++
		case c == '#':
			for i < len(s) && s[i] != '\n' {
				i++
			}
		case c == '"' || c == '\'' || c == '`':
			end, _, err := skipString(i)
			if err != nil {
				return nil, err
			}
			i = end
		case c == '$':
			i = skipGrafanaVar(i)
		case c == '[':
			k := strings.IndexByte(s[i:], ']')
			if k < 0 {
				return nil, fmt.Errorf("%w: unterminated [ in %q", errPromQL, expr)
			}
			if strings.HasPrefix(s[i:], "[[") { // Grafana's old [[var]] syntax
				k = strings.Index(s[i:], "]]") + 1
			}
			i += k + 1
		case c == '{':
			end, err := matchers(i)
			if err != nil {
				return nil, err
			}
			i = end
		case c == '.' || ('0' <= c && c <= '9'):
			for i < len(s) && (isIdent(s[i]) || s[i] == '.') {
				i++
			}
		case isIdentStart(c):
			k := i
			for k < len(s) && isIdent(s[k]) {
				k++
			}
			word := s[i:k]
			next := skipSpace(k)
			lower := strings.ToLower(word)
			switch {
			case labelListKeywords[lower] && next < len(s) && s[next] == '(':
				end := strings.IndexByte(s[next:], ')')
				if end < 0 {
					return nil, fmt.Errorf("%w: unterminated label list in %q", errPromQL, expr)
				}
				k = next + end + 1
			case lower == "offset":
				// offset 5m / offset -1h: skip the duration.
				j := next
				if j < len(s) && s[j] == '-' {
					j++
				}
				for j < len(s) && isIdent(s[j]) {
					j++
				}
				k = j
			case promqlKeywords[lower]:
			case next < len(s) && s[next] == '(':
				// A function call.
			default:
				names = append(names, word)
			}
			i = k
		default:
			return nil, fmt.Errorf("%w: unexpected %q at %d in %q", errPromQL, c, i, expr)
		}
	}
	if depth != 0 {
		return nil, fmt.Errorf("%w: unbalanced ( in %q", errPromQL, expr)
	}
	slices.Sort(names)
	return slices.Compact(names), nil
}

func TestMetricNames(t *testing.T) {
	cases := []struct {
		expr string
		want []string
	}{
		{`up`, []string{"up"}},
		{`up{job="kvmesh"} == 0`, []string{"up"}},
		{`sum by (selection) (rate(aibrix_prefix_cache_routing_selection_total{model="m"}[1m]))`,
			[]string{"aibrix_prefix_cache_routing_selection_total"}},
		{`sum by (node_alias) (rate(vllm:prefix_cache_hits_total{model_name="m"}[1m]))
/
sum by (node_alias) (rate(vllm:prefix_cache_queries_total{model_name="m"}[1m]))`,
			[]string{"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"}},
		{`histogram_quantile(0.95, sum by (le, phase) (rate(routing_study_ttft_seconds_bucket{job="q"}[1m])))`,
			[]string{"routing_study_ttft_seconds_bucket"}},
		// Aggregation modifiers after the body; label lists never count.
		{`sum(rate(a_total[5m])) without (instance, job)`, []string{"a_total"}},
		{`a / on (replica) group_left (model) b`, []string{"a", "b"}},
		{`a unless on (replica) b > 0`, []string{"a", "b"}},
		{`a and ignoring(code) b or c`, []string{"a", "b", "c"}},
		// Keywords are case-insensitive; bool modifier; numbers and literals.
		{`SUM BY (x) (a) > BOOL 0.5e3 + Inf - NaN + 0x1F`, []string{"a"}},
		// or vector(0): a function, not a metric.
		{`(sum(rate(x_total{code=~"5xx|error"}[5m])) or vector(0)) / sum(rate(y_total[5m]))`, []string{"x_total", "y_total"}},
		// Strings that look like identifiers, escaped quotes, regex escapes.
		{`a{le=~"30(\\.0)?", b="c \" d", e='f'}`, []string{"a"}},
		{"label_replace(a, \"dst\", \"$1\", \"src\", `(.*)`)", []string{"a"}},
		// __name__ matchers; regex __name__ matchers name no single metric.
		{`{__name__="kvmesh_x_total", job="j"}`, []string{"kvmesh_x_total"}},
		{`{__name__=~"kvmesh_.*"}`, nil},
		// offset and @ modifiers, subqueries, durations.
		{`rate(a[5m] offset 1h) - rate(a[5m] offset -30m) + b @ 1609746000 + max_over_time(c[1h:5m])`, []string{"a", "b", "c"}},
		// Grafana variables.
		{`sum by (replica) (rate(a{model=~"$model"}[$__rate_interval])) / b{x="${v:regex}"} + c[[interval]]`, []string{"a", "b", "c"}},
		// Recording-rule names with colons.
		{`kvmesh:slo_ttft_over_2s:ratio_rate1h > (14.4 * 0.05)`, []string{"kvmesh:slo_ttft_over_2s:ratio_rate1h"}},
		// Comments.
		{"a # b\n+ c", []string{"a", "c"}},
		// Duplicates collapse.
		{`a + a`, []string{"a"}},
		{`vector(1)`, nil},
	}
	for _, c := range cases {
		got, err := metricNames(c.expr)
		if err != nil {
			t.Errorf("metricNames(%q): %v", c.expr, err)
			continue
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("metricNames(%q) = %q, want %q", c.expr, got, c.want)
		}
	}
}

func TestMetricNamesRejectsBrokenExpressions(t *testing.T) {
	for _, expr := range []string{
		`sum(rate(a[5m])`,
		`rate(a[5m]))`,
		`a{job="x}`,
		`a{job}`,
		`a{job=}`,
		`a[5m`,
		`a ; b`,
	} {
		if _, err := metricNames(expr); !errors.Is(err, errPromQL) {
			t.Errorf("metricNames(%q) err = %v, want errPromQL", expr, err)
		}
	}
}
