package httpenv

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Sample is one line of the Prometheus text exposition format.
type Sample struct {
	Name   string
	Labels map[string]string
	Value  float64
}

// ParseMetrics parses the Prometheus text format (version 0.0.4): comments
// and blank lines are skipped; every other line is name{labels} value
// [timestamp]. It returns ErrMetrics for a malformed line.
func ParseMetrics(r io.Reader) ([]Sample, error) {
	var out []Sample
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	line := 0
	for sc.Scan() {
		line++
		s := strings.TrimSpace(sc.Text())
		if s == "" || s[0] == '#' {
			continue
		}
		smp, err := parseLine(s)
		if err != nil {
			return nil, fmt.Errorf("%w: line %d: %v", ErrMetrics, line, err)
		}
		out = append(out, smp)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrMetrics, err)
	}
	return out, nil
}

func parseLine(s string) (Sample, error) {
	smp := Sample{}
	i := strings.IndexAny(s, "{ \t")
	if i <= 0 {
		return smp, fmt.Errorf("no value in %q", s)
	}
	smp.Name = s[:i]
	rest := s[i:]
	if rest[0] == '{' {
		labels, n, err := parseLabels(rest)
		if err != nil {
			return smp, err
		}
		smp.Labels = labels
		rest = rest[n:]
	}
	fields := strings.Fields(rest)
	if len(fields) < 1 || len(fields) > 2 {
		return smp, fmt.Errorf("bad value part %q", rest)
	}
	v, err := parseValue(fields[0])
	if err != nil {
		return smp, err
	}
	smp.Value = v
	return smp, nil
}

func parseValue(s string) (float64, error) {
	switch s {
	case "+Inf":
		return math.Inf(1), nil
	case "-Inf":
		return math.Inf(-1), nil
	case "NaN":
		return math.NaN(), nil
	}
	return strconv.ParseFloat(s, 64)
}

// parseLabels parses {a="x",b="y"} at the start of s and returns the labels
// and the number of bytes consumed.
func parseLabels(s string) (map[string]string, int, error) {
	labels := map[string]string{}
	i := 1
	for {
		for i < len(s) && (s[i] == ' ' || s[i] == ',') {
			i++
		}
		if i >= len(s) {
			return nil, 0, fmt.Errorf("unterminated labels")
		}
		if s[i] == '}' {
			return labels, i + 1, nil
		}
		eq := strings.IndexByte(s[i:], '=')
		if eq <= 0 {
			return nil, 0, fmt.Errorf("bad label at %q", s[i:])
		}
		name := strings.TrimSpace(s[i : i+eq])
		i += eq + 1
		if i >= len(s) || s[i] != '"' {
			return nil, 0, fmt.Errorf("label %s: value not quoted", name)
		}
		i++
		var b strings.Builder
		for {
			if i >= len(s) {
				return nil, 0, fmt.Errorf("label %s: unterminated value", name)
			}
			c := s[i]
			if c == '"' {
				i++
				break
			}
			if c == '\\' && i+1 < len(s) {
				i++
				switch s[i] {
				case 'n':
					b.WriteByte('\n')
				default:
					b.WriteByte(s[i])
				}
				i++
				continue
			}
			b.WriteByte(c)
			i++
		}
		labels[name] = b.String()
	}
}

// Sum returns the sum of every sample named name (over all label sets), and
// whether any was present.
func Sum(samples []Sample, name string) (float64, bool) {
	v, ok := 0.0, false
	for _, s := range samples {
		if s.Name == name {
			v += s.Value
			ok = true
		}
	}
	return v, ok
}

// ByLabels sums the samples named name by their label values joined with
// "/": first the labels named in order (when present), then the others in
// sorted name order, leaving out the labels in skip.
func ByLabels(samples []Sample, name string, order, skip []string) map[string]float64 {
	out := map[string]float64{}
	for _, s := range samples {
		if s.Name != name {
			continue
		}
		var vals, rest []string
		for _, k := range order {
			if v, ok := s.Labels[k]; ok && !slices.Contains(skip, k) {
				vals = append(vals, v)
			}
		}
		for k := range s.Labels {
			if !slices.Contains(order, k) && !slices.Contains(skip, k) {
				rest = append(rest, k)
			}
		}
		sort.Strings(rest)
		for _, k := range rest {
			vals = append(vals, s.Labels[k])
		}
		out[strings.Join(vals, "/")] += s.Value
	}
	return out
}
