package suite

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/chaos/cluster"
)

// Report is a run's outcome in the form written to disk.
type Report struct {
	Form     string    `json:"form"` // "short" or "long"
	Factor   float64   `json:"factor,omitempty"`
	Started  time.Time `json:"started"`
	Elapsed  float64   `json:"elapsed_s"`
	Passed   bool      `json:"passed"`
	Results  []Result  `json:"results"`
	Lost     int       `json:"lost"`
	Requests int       `json:"requests"`
}

// NewReport sums results of a run that began at started.
func NewReport(size Size, started time.Time, rs []Result) Report {
	form := "short"
	if size.Long {
		form = "long"
	}
	r := Report{Form: form, Factor: size.Factor, Started: started, Elapsed: time.Since(started).Seconds(), Passed: !Failed(rs), Results: rs}
	for _, res := range rs {
		for _, row := range res.Rows {
			r.Lost += row.Load.Lost
			r.Requests += row.Load.Sent
		}
	}
	return r
}

// JSON is the report as indented JSON.
func (r Report) JSON() ([]byte, error) { return json.MarshalIndent(r, "", "  ") }

// Markdown is the report as a Markdown table: one line per row a scenario
// recorded (a scenario that failed before recording one gets a line of
// its own), then the totals and every failure.
func (r Report) Markdown() string {
	var b strings.Builder
	verdict := "PASS"
	if !r.Passed {
		verdict = "FAIL"
	}
	fmt.Fprintf(&b, "# kvmesh chaos suite (%s form", r.Form)
	if r.Factor > 0 && r.Factor != 1 {
		fmt.Fprintf(&b, ", factor %g", r.Factor)
	}
	fmt.Fprintf(&b, "): %s\n\nStarted %s, took %.0f s.\n\n", verdict, r.Started.UTC().Format(time.RFC3339), r.Elapsed)
	b.WriteString("| scenario | result | sent | ok | failed | lost | precision | recall | converge | config | notes |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|\n")
	var tot cluster.LoadResult
	for _, res := range r.Results {
		status := "ok"
		if !res.Passed {
			status = "**FAIL**"
		}
		if len(res.Rows) == 0 {
			fmt.Fprintf(&b, "| %s | %s | | | | | | | | | no row recorded |\n", res.Name, status)
			continue
		}
		for _, row := range res.Rows {
			cv := row.ConfigVersions
			if cv == "" {
				cv = "-"
			}
			fmt.Fprintf(&b, "| %s | %s | %d | %d | %d | %d | %.4f | %.4f | %v | %s | %s |\n", row.Scenario, status,
				row.Load.Sent, row.Load.OK, row.Load.Failed, row.Load.Lost, row.Precision, row.Recall,
				row.Converge.Round(time.Millisecond), mdEscape(cv), mdEscape(row.Note))
			tot.Sent += row.Load.Sent
			tot.OK += row.Load.OK
			tot.Failed += row.Load.Failed
			tot.Lost += row.Load.Lost
		}
	}
	fmt.Fprintf(&b, "| TOTAL | | %d | %d | %d | %d | | | | | |\n", tot.Sent, tot.OK, tot.Failed, tot.Lost)
	for _, res := range r.Results {
		for _, f := range res.Failures {
			fmt.Fprintf(&b, "\n- %s failed: %s", res.Name, firstLines(f, 6))
		}
	}
	if !r.Passed {
		b.WriteString("\n")
	}
	return b.String()
}

func mdEscape(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(s)
}

func firstLines(s string, n int) string {
	ls := strings.Split(s, "\n")
	if len(ls) > n {
		ls = append(ls[:n], "...")
	}
	return strings.Join(ls, " ")
}
