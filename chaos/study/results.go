package study

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// Num is a float64 that encodes NaN as JSON null (and decodes null as NaN):
// a statistic that could not be computed is missing, never zero.
type Num float64

// MarshalJSON implements json.Marshaler.
func (n Num) MarshalJSON() ([]byte, error) {
	f := float64(n)
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return []byte("null"), nil
	}
	return strconv.AppendFloat(nil, f, 'g', -1, 64), nil
}

// UnmarshalJSON implements json.Unmarshaler.
func (n *Num) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*n = Num(math.NaN())
		return nil
	}
	f, err := strconv.ParseFloat(string(b), 64)
	if err != nil {
		return fmt.Errorf("%w: number %q", ErrBadRecord, b)
	}
	*n = Num(f)
	return nil
}

// Run is one row of results.json: one measured phase, in exactly the schema
// issue 5 specifies.
type Run struct {
	Scenario string `json:"scenario"`
	Round    int    `json:"round"`
	Strategy string `json:"strategy"`
	Mode     string `json:"mode"`
	Gateways int    `json:"gateways"`
	// Isolated marks a run of several gateways sharing nothing (the
	// --no-sync baseline); false for one gateway or a synced cluster.
	Isolated     bool           `json:"isolated,omitempty"`
	Replicas     int            `json:"replicas"`
	Arrivals     int            `json:"arrivals"`
	Succeeded    int            `json:"succeeded"`
	Failed       int            `json:"failed"`
	SLOPass      int            `json:"slo_pass"`
	TTFTP95      Num            `json:"ttft_p95_s"`
	TPOTP95      Num            `json:"tpot_p95_ms"`
	E2EP95       Num            `json:"e2e_p95_s"`
	TokenHitRate Num            `json:"token_hit_rate"`
	PerReplica   map[string]int `json:"per_replica"`
	Selection    map[string]int `json:"selection"`
	MaxWaiting   map[string]int `json:"max_waiting"`
}

// SyncSingle is the "sync" of a one-gateway run (nothing to share); runs
// of several gateways say SyncSynced or SyncIsolated.
const SyncSingle = "single"

// SyncSetting names r's sync axis: single, synced or isolated.
func (r *Run) SyncSetting() string {
	switch {
	case r.Isolated:
		return SyncIsolated
	case r.Gateways > 1:
		return SyncSynced
	}
	return SyncSingle
}

// MarshalJSON writes r with its sync setting spelled out ("sync"), so a
// reader tells the synced and isolated runs of one strategy and mode
// apart without knowing that isolated is omitted when false.
func (r Run) MarshalJSON() ([]byte, error) {
	type plain Run
	return json.Marshal(struct {
		plain
		Sync string `json:"sync"`
	}{plain(r), r.SyncSetting()})
}

// Key returns the phase key of r.
func (r *Run) Key() PhaseKey {
	return PhaseKey{Scenario: r.Scenario, Round: r.Round, Strategy: r.Strategy, Mode: r.Mode, Gateways: r.Gateways,
		Isolated: r.Isolated}
}

// PhaseKey identifies a phase across files.
type PhaseKey struct {
	Scenario string
	Round    int
	Strategy string
	Mode     string
	Gateways int
	Isolated bool
}

// PhaseName returns the canonical phase name, e.g.
// "r1-hot50-prefix-cache@history/g1" or, for isolated gateways,
// "r1-hot50-prefix-cache@history/g3-isolated".
func (k PhaseKey) PhaseName() string {
	return fmt.Sprintf("r%d-%s-%s@%s", k.Round, k.Scenario, k.Strategy, cellName(k.Mode, k.Gateways, k.Isolated))
}

// ResultsSchemaVersion is results.json's schema_version; docs/results.md
// documents each version. 2: every run carries "sync"; the file carries
// schema_version (a file without it is version 1).
const ResultsSchemaVersion = 2

// Results is everything a study produced.
type Results struct {
	// SchemaVersion is ResultsSchemaVersion when written by WriteFiles.
	SchemaVersion int             `json:"schema_version"`
	Runs          []Run           `json:"runs"`
	Config        Config          `json:"config"`
	Requests      []RequestRecord `json:"-"`
	Phases        []PhaseDetail   `json:"-"`
}

// PhaseDetail is the per-phase evidence that does not fit results.json's
// fixed schema; it is written to phases.json and feeds the HTML charts.
type PhaseDetail struct {
	Name     string   `json:"name"`
	Scenario string   `json:"scenario"`
	Round    int      `json:"round"`
	Strategy string   `json:"strategy"`
	Mode     string   `json:"mode"`
	Gateways int      `json:"gateways"`
	Isolated bool     `json:"isolated,omitempty"`
	Replicas []string `json:"replicas"`
	// Measured is false when initialisation failed and no arrivals ran.
	Measured bool   `json:"measured"`
	Error    string `json:"error,omitempty"`
	// Init is the initial-state evidence (placements, attempts).
	Init InitInfo `json:"init"`
	// SettleMS is the wall time the engine took to bring every gateway
	// to the initialisation's state (Settler; synced gateways only).
	SettleMS float64 `json:"settle_ms,omitempty"`
	// StartS and EndS are the model times of the first arrival and of the
	// last completion, on the engine's clock.
	StartS float64 `json:"start_s"`
	EndS   float64 `json:"end_s"`
	// Unsent counts arrivals the in-flight cap kept back.
	Unsent int `json:"unsent"`
	// LagP95S and LagMaxS describe how late single-turn arrivals were sent
	// against their schedule (model seconds). On a live engine a lag of
	// more than a few tens of milliseconds means the host did not keep up
	// with the speed factor, and the phase's latencies are inflated too.
	LagP95S Num `json:"lag_p95_s"`
	LagMaxS Num `json:"lag_max_s"`
	// PromptTokens and CompletionTokens are client-side usage totals.
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	// OutputTokensPerS is completion tokens over the measurement interval,
	// including the tail drain.
	OutputTokensPerS Num `json:"output_tokens_per_s"`
	// QueriesDelta and HitsDelta are the engines' prefix-cache counter
	// deltas per replica; SuccessDelta their completed requests.
	QueriesDelta []float64 `json:"queries_delta"`
	HitsDelta    []float64 `json:"hits_delta"`
	SuccessDelta []float64 `json:"success_delta"`
	// Samples are the engine gauge samples, relative to StartS.
	Samples []Observation `json:"samples"`
}

// RequestRecord is one line of requests.jsonl: one scheduled arrival.
// Times are model seconds; Scheduled and Start are relative to the phase's
// first arrival.
type RequestRecord struct {
	Phase     string `json:"phase"`
	Scenario  string `json:"scenario"`
	Round     int    `json:"round"`
	Strategy  string `json:"strategy"`
	Mode      string `json:"mode"`
	Gateways  int    `json:"gateways"`
	Isolated  bool   `json:"isolated,omitempty"`
	Seq       int    `json:"seq"`
	Group     int    `json:"group"`
	Document  int    `json:"document"`
	Session   int    `json:"session,omitempty"`
	Turn      int    `json:"turn,omitempty"`
	Gateway   int    `json:"gateway"`
	MaxTokens int    `json:"max_tokens"`
	// Sent is false for an arrival the in-flight cap (or an aborted
	// session) kept back.
	Sent      bool    `json:"sent"`
	Scheduled float64 `json:"scheduled_s"`
	Start     float64 `json:"start_s"`
	Replica   string  `json:"replica"`
	Status    int     `json:"status"`
	TTFT      float64 `json:"ttft_s"`
	Last      float64 `json:"last_content_s"`
	E2E       float64 `json:"e2e_s"`
	TPOTms    float64 `json:"tpot_ms"`
	Chunks    int     `json:"content_chunks"`
	Done      bool    `json:"done"`
	Usage     *Usage  `json:"usage"`
	Complete  bool    `json:"complete"`
	Pass      bool    `json:"pass"`
	Err       string  `json:"error,omitempty"`
}

// Usage is the usage object a stream reported.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	CachedTokens     int `json:"cached_tokens,omitempty"`
}

func secs(d time.Duration) float64 { return d.Seconds() }

func dur(s float64) time.Duration { return time.Duration(math.Round(s * float64(time.Second))) }

// fill stores o into r; phaseStart converts o.Start to a phase-relative time.
func (r *RequestRecord) fill(o Outcome, phaseStart time.Duration, slo SLO) {
	r.Sent = true
	r.Start = secs(o.Start - phaseStart)
	r.Replica = o.Replica
	r.Status = o.Status
	r.TTFT = secs(o.FirstContent)
	r.Last = secs(o.LastContent)
	r.E2E = secs(o.End)
	r.TPOTms = float64(TPOT(o)) / float64(time.Millisecond)
	r.Chunks = o.ContentChunks
	r.Done = o.GotDone
	if o.HasUsage {
		r.Usage = &Usage{PromptTokens: o.PromptTokens, CompletionTokens: o.CompletionTokens}
		if o.CachedTokens > 0 {
			r.Usage.CachedTokens = o.CachedTokens
		}
	}
	r.Complete = Complete(o, r.MaxTokens)
	r.Pass = slo.Pass(o, r.MaxTokens)
	r.Err = o.Err
}

// Outcome reconstructs the client observation from a record, so the
// statistics can be recomputed offline from requests.jsonl alone.
func (r *RequestRecord) Outcome() Outcome {
	o := Outcome{
		Start:         dur(r.Start),
		Status:        r.Status,
		Replica:       r.Replica,
		FirstContent:  dur(r.TTFT),
		LastContent:   dur(r.Last),
		End:           dur(r.E2E),
		ContentChunks: r.Chunks,
		GotDone:       r.Done,
		CachedTokens:  -1,
		Err:           r.Err,
	}
	if r.Usage != nil {
		o.HasUsage = true
		o.PromptTokens = r.Usage.PromptTokens
		o.CompletionTokens = r.Usage.CompletionTokens
	}
	return o
}

// Key returns the phase key of the record.
func (r *RequestRecord) Key() PhaseKey {
	return PhaseKey{Scenario: r.Scenario, Round: r.Round, Strategy: r.Strategy, Mode: r.Mode, Gateways: r.Gateways,
		Isolated: r.Isolated}
}

// File names inside the output directory.
const (
	FileResults  = "results.json"
	FileRequests = "requests.jsonl"
	FilePhases   = "phases.json"
	FileReport   = "report.md"
	FileHTML     = "report.html"
)

// WriteFiles writes results.json, requests.jsonl, phases.json, report.md and
// report.html into dir, creating it if needed.
func WriteFiles(dir string, res *Results) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	res.SchemaVersion = ResultsSchemaVersion
	if err := writeJSON(filepath.Join(dir, FileResults), res); err != nil {
		return err
	}
	if err := writeJSON(filepath.Join(dir, FilePhases), res.Phases); err != nil {
		return err
	}
	if err := writeWith(filepath.Join(dir, FileRequests), func(w io.Writer) error {
		return WriteRequests(w, res.Requests)
	}); err != nil {
		return err
	}
	if err := writeWith(filepath.Join(dir, FileReport), func(w io.Writer) error {
		return WriteMarkdown(w, res)
	}); err != nil {
		return err
	}
	return writeWith(filepath.Join(dir, FileHTML), func(w io.Writer) error {
		return WriteHTML(w, res)
	})
}

func writeJSON(path string, v any) error {
	return writeWith(path, func(w io.Writer) error {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	})
}

func writeWith(path string, fn func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	bw := bufio.NewWriter(f)
	if err := fn(bw); err != nil {
		_ = f.Close()
		return err
	}
	if err := bw.Flush(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// WriteRequests writes one JSON object per line.
func WriteRequests(w io.Writer, recs []RequestRecord) error {
	enc := json.NewEncoder(w)
	for i := range recs {
		if err := enc.Encode(&recs[i]); err != nil {
			return err
		}
	}
	return nil
}

// ReadRequests reads requests.jsonl.
func ReadRequests(r io.Reader) ([]RequestRecord, error) {
	var out []RequestRecord
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	line := 0
	for sc.Scan() {
		line++
		if len(sc.Bytes()) == 0 {
			continue
		}
		var rec RequestRecord
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			return nil, fmt.Errorf("%w: line %d: %v", ErrBadRecord, line, err)
		}
		out = append(out, rec)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

// ReadResults reads results.json.
func ReadResults(r io.Reader) (*Results, error) {
	var res Results
	if err := json.NewDecoder(r).Decode(&res); err != nil {
		return nil, fmt.Errorf("%w: results: %v", ErrBadRecord, err)
	}
	return &res, nil
}

// ReadDir reads a study's output directory back: results.json,
// requests.jsonl and phases.json (the latter two optional), so reports can
// be re-rendered offline.
func ReadDir(dir string) (*Results, error) {
	f, err := os.Open(filepath.Join(dir, FileResults))
	if err != nil {
		return nil, err
	}
	res, err := ReadResults(f)
	_ = f.Close()
	if err != nil {
		return nil, err
	}
	if rf, err := os.Open(filepath.Join(dir, FileRequests)); err == nil {
		res.Requests, err = ReadRequests(rf)
		_ = rf.Close()
		if err != nil {
			return nil, err
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, FilePhases)); err == nil {
		if err := json.Unmarshal(b, &res.Phases); err != nil {
			return nil, fmt.Errorf("%w: phases: %v", ErrBadRecord, err)
		}
	}
	return res, nil
}

// WriteReports rewrites report.md and report.html in dir from res.
func WriteReports(dir string, res *Results) error {
	if err := writeWith(filepath.Join(dir, FileReport), func(w io.Writer) error {
		return WriteMarkdown(w, res)
	}); err != nil {
		return err
	}
	return writeWith(filepath.Join(dir, FileHTML), func(w io.Writer) error {
		return WriteHTML(w, res)
	})
}
