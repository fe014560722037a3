// Package study is the engine-agnostic core of kvbench, the routing study
// harness: the seed study's workload (prompts, per-phase salts, arrival
// sequences), its scenarios and their initial cache and index states, the
// phase driver with fixed-rate arrivals and a client in-flight cap, the
// statistics (linear-interpolation P95, TPOT, the SLO pass rule over
// scheduled arrivals), and the outputs (results.json, requests.jsonl,
// phases.json, report.md, report.html, stdout tables).
//
// Everything here talks to the world through the Engine interface: a
// reactor with a model-time clock (Now, At), asynchronous requests (Send)
// and gauge samples (Observe), and synchronous control operations between
// phases (ResetCaches, Counters, WaitIdle), plus two optional ones: a
// HostChecker reports whether the host keeps model time, and a Settler
// waits after each initialisation until gateways that share an index
// asynchronously agree. A grid's cells (Config.Cells) are its index modes ×
// gateway counts × gateway sync settings (several gateways synced into one
// cluster, or isolated). The live engine
// (package chaos/study/httpenv with chaos/study/live) implements it over
// loopback HTTP against simulated engines and real gateways; a
// discrete-event engine implements the same interface in virtual time and
// reuses every scenario, the driver, the statistics and the report.
//
// All durations the package reports are model time: an engine running its
// simulators with a speed factor converts wall durations before they reach
// this package.
//
// Nothing in this package starts goroutines except through the Engine it is
// given; the Runner is not safe for concurrent use.
package study
