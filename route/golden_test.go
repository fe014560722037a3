package route

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/index"
)

var update = flag.Bool("update", false, "rewrite the expected outputs in testdata/*.txt")

// TestGolden runs every scenario script in testdata/ and compares each
// command's output with the block stored under it (STYLE 14). Run
// `go test ./route -run TestGolden -update` to regenerate the outputs after
// an intended behaviour change, then review the diff.
//
// Script format, one command per line (# starts a comment):
//
//	strategy NAME [key=value ...]   fresh strategy (and cost model); keys:
//	                                prefix-cache abs k local; consistent-hash vnodes c floor;
//	                                cost prefill decode out overhead chunk maxrun kvsat alpha minsample
//	                                peerdelay (seconds, Config.PeerLoadDelaySeconds)
//	seed N                          reseed the random generator
//	request key=value ...           blocks block_tokens prompt max_tokens session now (ms)
//	replica NAME key=value ...      add or update: match inflight local running waiting kv queued peerqueued
//	remove NAME                     drop a replica
//	observe NAME key=value ...      feed the cost model: uncached ttft queue tpot out [repeat]
//	pick [n=N] [commit] [explain]   decide; commit applies the decision (in-flight +1,
//	                                queued prefill += uncached, the replica now holds the prompt)
//	keys n=N                        route session keys 1..N, print the spread and how many
//	                                keys moved since the previous keys command
//	rates NAME                      print the cost model's belief about a replica
//
// Commands that print are followed by "----", their output and a blank line.
func TestGolden(t *testing.T) {
	files, err := filepath.Glob("testdata/*.txt")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no scenario scripts in testdata/")
	}
	for _, f := range files {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".txt"), func(t *testing.T) {
			runScript(t, f)
		})
	}
}

type scenario struct {
	t        *testing.T
	strategy Strategy
	model    *Model
	rng      Rand
	req      Request
	cands    []Candidate
	nextID   index.ReplicaID
	ids      map[string]index.ReplicaID
	lastKeys map[uint64]string
}

func runScript(t *testing.T, path string) {
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(string(raw), "\n"), "\n")
	sc := &scenario{t: t, rng: NewRand(1), ids: map[string]index.ReplicaID{},
		req: Request{TotalBlocks: 40, BlockTokens: 128}}
	var out strings.Builder
	for i := 0; i < len(lines); i++ {
		line := lines[i]
		out.WriteString(line + "\n")
		cmd := strings.TrimSpace(line)
		if cmd == "" || strings.HasPrefix(cmd, "#") {
			continue
		}
		// Collect the stored expectation, if any.
		var want []string
		if i+1 < len(lines) && lines[i+1] == "----" {
			j := i + 2
			for ; j < len(lines) && lines[j] != ""; j++ {
				want = append(want, lines[j])
			}
			i = j - 1 // the blank line after the block is copied as text
		}
		got := sc.exec(path, i+1, cmd)
		if got == nil {
			if want != nil {
				t.Errorf("%s: %q prints nothing but has an expected block", path, cmd)
			}
			continue
		}
		out.WriteString("----\n")
		for _, g := range got {
			out.WriteString(g + "\n")
		}
		if i+1 < len(lines) && lines[i+1] != "" {
			out.WriteString("\n")
		}
		if !*update && strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Errorf("%s: %s\n got:\n%s\nwant:\n%s", path, cmd, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}
	if *update {
		text := strings.TrimRight(out.String(), "\n") + "\n"
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// args parses key=value words and flags (words without '=').
func args(words []string) (kv map[string]string, flags map[string]bool) {
	kv, flags = map[string]string{}, map[string]bool{}
	for _, w := range words {
		if k, v, ok := strings.Cut(w, "="); ok {
			kv[k] = v
		} else {
			flags[w] = true
		}
	}
	return kv, flags
}

func (sc *scenario) fatalf(path string, line int, format string, a ...any) {
	sc.t.Fatalf("%s:%d: %s", path, line, fmt.Sprintf(format, a...))
}

func (sc *scenario) num(path string, line int, kv map[string]string, key string, dst *int) {
	if v, ok := kv[key]; ok {
		n, err := strconv.ParseInt(v, 0, 64)
		if err != nil {
			sc.fatalf(path, line, "%s=%q: %v", key, v, err)
		}
		*dst = int(n)
		delete(kv, key)
	}
}

func (sc *scenario) flt(path string, line int, kv map[string]string, key string, dst *float64) {
	if v, ok := kv[key]; ok {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			sc.fatalf(path, line, "%s=%q: %v", key, v, err)
		}
		*dst = f
		delete(kv, key)
	}
}

func (sc *scenario) noneLeft(path string, line int, kv map[string]string) {
	if len(kv) > 0 {
		sc.fatalf(path, line, "unknown keys %v", kv)
	}
}

func (sc *scenario) find(path string, line int, name string) int {
	for i := range sc.cands {
		if sc.cands[i].Name == name {
			return i
		}
	}
	sc.fatalf(path, line, "no replica %q", name)
	return -1
}

func (sc *scenario) exec(path string, line int, cmd string) []string {
	words := strings.Fields(cmd)
	kv, flags := args(words[1:])
	switch words[0] {
	case "strategy":
		sc.newStrategy(path, line, words[1], kv)
		return nil
	case "seed":
		n, err := strconv.ParseUint(words[1], 0, 64)
		if err != nil {
			sc.fatalf(path, line, "seed: %v", err)
		}
		sc.rng = NewRand(n)
		return nil
	case "request":
		sc.num(path, line, kv, "blocks", &sc.req.TotalBlocks)
		sc.num(path, line, kv, "block_tokens", &sc.req.BlockTokens)
		sc.num(path, line, kv, "prompt", &sc.req.PromptTokens)
		sc.num(path, line, kv, "max_tokens", &sc.req.MaxTokens)
		if _, ok := kv["now"]; ok {
			var ms int
			sc.num(path, line, kv, "now", &ms)
			sc.req.Now = int64(ms) * 1e6
		}
		var s int
		if _, ok := kv["session"]; ok {
			sc.num(path, line, kv, "session", &s)
			sc.req.SessionKey = uint64(s)
		}
		sc.noneLeft(path, line, kv)
		return nil
	case "replica":
		name := words[1]
		kv, _ = args(words[2:])
		i := -1
		for j := range sc.cands {
			if sc.cands[j].Name == name {
				i = j
			}
		}
		if i < 0 {
			id, ok := sc.ids[name]
			if !ok {
				id = sc.nextID
				sc.nextID++
				sc.ids[name] = id
			}
			sc.cands = append(sc.cands, Candidate{ID: id, Name: name, Running: Unknown, Waiting: Unknown, KVUsage: Unknown})
			i = len(sc.cands) - 1
		}
		c := &sc.cands[i]
		sc.num(path, line, kv, "match", &c.Matched)
		sc.num(path, line, kv, "inflight", &c.InFlight)
		sc.num(path, line, kv, "local", &c.LocalInFlight)
		sc.num(path, line, kv, "running", &c.Running)
		sc.num(path, line, kv, "waiting", &c.Waiting)
		sc.flt(path, line, kv, "kv", &c.KVUsage)
		sc.num(path, line, kv, "queued", &c.QueuedPrefillTokens)
		sc.num(path, line, kv, "peerqueued", &c.PeerQueuedPrefillTokens)
		sc.noneLeft(path, line, kv)
		return nil
	case "remove":
		i := sc.find(path, line, words[1])
		sc.cands = append(sc.cands[:i], sc.cands[i+1:]...)
		return nil
	case "observe":
		i := sc.find(path, line, words[1])
		kv, _ = args(words[2:])
		var obs Observation
		repeat := 1
		sc.num(path, line, kv, "uncached", &obs.UncachedTokens)
		sc.flt(path, line, kv, "ttft", &obs.TTFT)
		sc.flt(path, line, kv, "queue", &obs.QueueSeconds)
		sc.flt(path, line, kv, "tpot", &obs.TPOT)
		sc.num(path, line, kv, "out", &obs.OutputTokens)
		sc.num(path, line, kv, "repeat", &repeat)
		sc.noneLeft(path, line, kv)
		obs.QueueEstimated = true // the scripts observe cost's decisions
		if sc.model == nil {
			sc.fatalf(path, line, "observe needs the cost strategy")
		}
		for range repeat {
			sc.model.Observe(sc.cands[i].ID, obs)
		}
		return nil
	case "rates":
		if sc.model == nil {
			sc.fatalf(path, line, "rates needs the cost strategy")
		}
		r := sc.model.Rates(sc.cands[sc.find(path, line, words[1])].ID)
		return []string{fmt.Sprintf("prefill=%.0f tok/s decode_step=%.4fs out=%.1f samples=%d/%d",
			r.PrefillTokensPerSecond, r.DecodeStepSeconds, r.OutputTokens, r.PrefillSamples, r.DecodeSamples)}
	case "pick":
		return sc.pick(path, line, kv, flags)
	case "keys":
		return sc.keys(path, line, kv)
	}
	sc.fatalf(path, line, "unknown command %q", words[0])
	return nil
}

func (sc *scenario) newStrategy(path string, line int, name string, kv map[string]string) {
	cfg := DefaultConfig()
	sc.model = nil
	switch name {
	case NameRandom:
		sc.strategy = Random{}
	case NameLeastRequest:
		sc.strategy = LeastRequest{}
	case NamePrefixCache:
		sc.num(path, line, kv, "abs", &cfg.PrefixCache.ImbalanceAbsCount)
		sc.flt(path, line, kv, "k", &cfg.PrefixCache.StdDevFactor)
		var local int
		sc.num(path, line, kv, "local", &local)
		cfg.PrefixCache.LocalLoad = local != 0
		s, err := NewPrefixCache(cfg.PrefixCache)
		if err != nil {
			sc.fatalf(path, line, "%v", err)
		}
		sc.strategy = s
	case NameConsistentHash:
		sc.num(path, line, kv, "vnodes", &cfg.ConsistentHash.VirtualNodes)
		sc.flt(path, line, kv, "c", &cfg.ConsistentHash.LoadFactor)
		sc.num(path, line, kv, "floor", &cfg.ConsistentHash.MinCapacity)
		s, err := NewConsistentHash(cfg.ConsistentHash)
		if err != nil {
			sc.fatalf(path, line, "%v", err)
		}
		sc.strategy = s
	case NameCost:
		c := &cfg.Cost
		sc.flt(path, line, kv, "prefill", &c.PriorPrefillTokensPerSecond)
		sc.flt(path, line, kv, "decode", &c.PriorDecodeStepSeconds)
		sc.flt(path, line, kv, "out", &c.PriorOutputTokens)
		sc.flt(path, line, kv, "overhead", &c.PrefillOverheadSeconds)
		sc.num(path, line, kv, "chunk", &c.ChunkTokens)
		sc.num(path, line, kv, "maxrun", &c.MaxRunning)
		sc.flt(path, line, kv, "kvsat", &c.KVSaturation)
		sc.flt(path, line, kv, "alpha", &c.Alpha)
		sc.num(path, line, kv, "minsample", &c.MinSampleTokens)
		sc.flt(path, line, kv, "peerdelay", &cfg.PeerLoadDelaySeconds)
		set, err := NewSet(cfg)
		if err != nil {
			sc.fatalf(path, line, "%v", err)
		}
		sc.model = set.Model()
		sc.strategy = set.Cost
	default:
		sc.fatalf(path, line, "unknown strategy %q", name)
	}
	sc.noneLeft(path, line, kv)
}

func decisionLine(cands []Candidate, d Decision) string {
	s := cands[d.Index].Name + " " + d.Selection.String()
	if d.LoadImbalanced {
		s += " imbalanced"
	}
	if d.EstimatedTTFT > 0 {
		s += fmt.Sprintf(" ttft=%.3fs queue=%.3fs", d.EstimatedTTFT, d.EstimatedQueue)
	}
	return s
}

func (sc *scenario) pick(path string, line int, kv map[string]string, flags map[string]bool) []string {
	n := 1
	sc.num(path, line, kv, "n", &n)
	sc.noneLeft(path, line, kv)
	if len(sc.cands) == 0 {
		sc.fatalf(path, line, "pick with no replicas")
	}
	var out []string
	counts := map[string]int{}
	labels := map[string]int{}
	for k := 0; k < n; k++ {
		var ex *Explanation
		if flags["explain"] {
			ex = &Explanation{}
		}
		d := sc.strategy.Pick(&sc.req, sc.cands, &sc.rng, ex)
		if n == 1 || flags["commit"] {
			out = append(out, decisionLine(sc.cands, d))
		}
		counts[sc.cands[d.Index].Name]++
		labels[d.Selection.String()]++
		if ex != nil {
			out = append(out, explainLines(ex)...)
		}
		if flags["commit"] {
			c := &sc.cands[d.Index]
			c.QueuedPrefillTokens += sc.req.UncachedTokens(c.Matched)
			c.InFlight++
			c.LocalInFlight++
			c.Matched = sc.req.TotalBlocks
		}
	}
	if n > 1 && !flags["commit"] {
		out = append(out, "replicas: "+countLine(counts), "labels: "+countLine(labels))
	}
	return out
}

func explainLines(ex *Explanation) []string {
	head := fmt.Sprintf("  %s bound=%.3f unit=%s", ex.Strategy, ex.Bound, ex.ScoreUnit)
	if ex.UnseenPeerRequests > 0 {
		head += fmt.Sprintf(" unseen=%d", ex.UnseenPeerRequests)
	}
	out := []string{head}
	for _, r := range ex.Replicas {
		mark := " "
		if r.Picked {
			mark = "*"
		}
		s := fmt.Sprintf("  %s %s match=%d(%.2f) inflight=%d score=%.4g", mark, r.Name, r.Matched, r.MatchFraction, r.InFlight, r.Score)
		if r.Filtered != NotFiltered {
			s += " filtered=" + r.Filtered.String()
		}
		out = append(out, s)
	}
	return out
}

func countLine(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, m[k])
	}
	return strings.Join(parts, " ")
}

func (sc *scenario) keys(path string, line int, kv map[string]string) []string {
	n := 0
	sc.num(path, line, kv, "n", &n)
	sc.noneLeft(path, line, kv)
	counts := map[string]int{}
	now := make(map[uint64]string, n)
	moved := 0
	saved := sc.req.SessionKey
	for k := 1; k <= n; k++ {
		sc.req.SessionKey = uint64(k)
		d := sc.strategy.Pick(&sc.req, sc.cands, &sc.rng, nil)
		name := sc.cands[d.Index].Name
		counts[name]++
		now[uint64(k)] = name
		if prev, ok := sc.lastKeys[uint64(k)]; ok && prev != name {
			moved++
		}
	}
	sc.req.SessionKey = saved
	out := []string{"replicas: " + countLine(counts)}
	if sc.lastKeys != nil {
		out = append(out, fmt.Sprintf("moved: %d of %d (%.1f%%)", moved, n, 100*float64(moved)/float64(n)))
	}
	sc.lastKeys = now
	return out
}
