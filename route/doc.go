// Package route decides which replica serves a request: the strategies
// (filter → score → pick), their configuration, the cost model that learns
// replica speed online, and the explanation of a decision.
//
// # Contract
//
// The package is pure (STYLE 1): it starts no goroutines, opens no sockets
// and never reads the clock (Request.Now carries time). Every random choice
// comes from the *Rand passed to Pick, so given the same inputs and seed a
// strategy makes the same decision; golden traces in testdata/ rely on it.
// The cost strategy's decision also depends on its Model, which learns
// from Observe and, in Pick, the running-set sizes the scraped load shows
// (maxima only), and on its own recent decisions: with peers' load in the
// view, they estimate the requests peers sent that no load report shows
// yet (see Cost.Pick; an explained Pick is not counted, so explaining a
// decision repeats it).
//
// Strategies take numbers, not index state: one Candidate per healthy
// replica with its match length (Matched, in blocks) and its load view
// (cluster-wide and local in-flight counts, engine-scraped running/waiting/
// KV usage, queued prefill tokens). The routing core (Scratch.Route) builds
// them: it matches the prompt's keys in an IndexView, asks the caller's
// LoadView for each replica's load by position, lets the strategy pick and
// returns the ledger to record the decision in and the Observation to
// complete and learn from when the stream ends. The gateway (node) and the
// discrete-event simulator (chaos/des) both route through it, so the
// simulator's decision flow is the gateway's. SessionKey and NewRequest
// build the Request both pass. The caller owns the []Candidate and may
// reuse it; no strategy keeps it. Pick requires len(cands) ≥ 1 (answering "no healthy
// replica" is the caller's job) and returns an index into cands plus a
// Selection label for metrics.
//
// Concurrency: every Strategy may be called concurrently. A *Rand and an
// *Explanation must not be shared between concurrent Picks. Model.Observe
// may be called from any goroutine (it takes a write lock); the cost
// strategy reads the model under one read lock per Pick and raises its
// running-set figures with atomic operations. ConsistentHash's
// ring is rebuilt only when membership changes (SetMembers, or once when
// Pick meets an unknown candidate) and swapped atomically.
//
// Allocation: Pick does not allocate in steady state for any strategy
// (tests assert it with testing.AllocsPerRun; benchmarks report it). Pass a
// nil *Explanation on the hot path; an Explanation reuses its slice.
//
// # Strategies
//
//   - random: uniform (Random).
//   - least-request: fewest cluster-wide in-flight, random tie-break
//     (LeastRequest).
//   - prefix-cache: AIBrix v0.7.0 semantics, thresholds configurable
//     (PrefixCache).
//   - consistent-hash: ring with virtual nodes, bounded-load spillover
//     (ConsistentHash, Ring).
//   - cost: estimated TTFT from queued prefill, this request's uncached
//     prefill, decode interference and slot wait, plus the delay a
//     recompute imposes on a full replica's queue, with per-replica rates
//     and running-set sizes learned online; near-ties go to locality, then
//     to the less loaded; with several gateways, the requests peers sent
//     since their last load report are estimated and placed first, and
//     the pick is a random one of the placements, so gateways sharing a
//     stale view do not herd (Cost, Model, Config.PeerLoadDelaySeconds).
//
// Set holds one of each, built from a Config (DefaultConfig + Validate).
//
// # Tests
//
// testdata/*.txt are golden scenario scripts (format in golden_test.go);
// `go test ./route -run TestGolden -update` regenerates their expected
// outputs. prefix-cache is also checked against a literal transliteration
// of AIBrix's code on random scenarios, and FuzzPick feeds every strategy
// inconsistent inputs (`go test ./route -run XXX -fuzz FuzzPick`).
package route
