package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvmesh/kvmesh/internal/gosched"
)

// proxyOpts are `kvbench proxybench`'s flags.
type proxyOpts struct {
	streams   []int
	perWorker int
	rounds    int
	tokens    int
	gap       time.Duration
	prompt    int
	kvmesh    string
	baseline  string
	goFloor   bool // also measure the Go floor (proxybench_goproxy.go)
	rawFloor  bool // also measure the raw floor (proxybench_rawfloor.go)
	procs     int  // GOMAXPROCS for the kvmesh target (0: the runtime's default)
	nginx     string
	strategy  string
	indexMode string
	strace    bool
	profile   string // directory for CPU profiles of the kvmesh targets ("": none)
	profSecs  int    // length of each profile
	trace     string // directory for execution traces of the kvmesh targets ("": none)
	traceSecs int    // length of each trace
	out       string
	timeout   time.Duration
	noInstall bool
}

func defaultProxyOpts() proxyOpts {
	return proxyOpts{
		streams: []int{20, 200}, perWorker: 5, rounds: 4, tokens: 8, gap: 20 * time.Millisecond,
		prompt: 2048, strategy: "cost", indexMode: "history", timeout: 10 * time.Minute, profSecs: 10, traceSecs: 2,
	}
}

// Targets of one proxybench run, in the order of the first round.
const (
	targetDirect = "direct"
	targetNginx  = "nginx"
	targetKvmesh = "kvmesh"
	// targetBaseline is a second kvmesh binary (--baseline-kvmesh).
	targetBaseline = "kvmesh-baseline"
	// targetGoFloor is httputil.ReverseProxy alone (--go-floor).
	targetGoFloor = "go-floor"
	// targetRawFloor is a Go proxy without net/http (--raw-floor).
	targetRawFloor = "raw-floor"
)

func newProxybenchCmd(stdout, stderr io.Writer) *cobra.Command {
	o := defaultProxyOpts()
	cmd := &cobra.Command{
		Use:   "proxybench",
		Short: "kvmesh against nginx as a streaming proxy: added TTFB, inter-chunk gaps, CPU per 1,000 requests",
		Long: `proxybench measures what the gateway adds to a streaming request, side by side
with nginx, all as separate processes on loopback: two trivial engines (this
binary's hidden proxybench-engine subcommand; each answer is --tokens content
events plus a usage+[DONE] chunk, paced --gap apart, the first at once),
nginx (one worker, upstream keep-alive, proxy_buffering off, round-robin over
both engines), and kvmesh serve (--strategy, --index-mode) over the same two.
This process is the load generator.

For each --streams value, each round runs one block per target (direct to
the engines round-robin, through nginx, through kvmesh; the order rotates per
round): that many workers with staggered starts each send --per-worker
streaming completions (a --prompt-byte prompt with a shared prefix) back to
back. Every answer is checked byte for byte against the engine's stream.
It reports TTFB (request sent to first body byte) and inter-chunk gap
percentiles, both also as added over direct, CPU seconds per 1,000 requests
of the nginx processes and of kvmesh read from /proc around their blocks
(and of this process, whose work competes with theirs on shared cores),
and uptime before and after; for the figures issue 21 compares, also their
5th–95th percentile over resamples of the rounds (how much they move with
the rounds that happened to run). --strace adds one block per proxy under
strace -c -f and reports syscalls per 1,000 requests (untimed). --profile DIR
takes a CPU profile of each kvmesh target from its own /debug/pprof/ (an admin
token made up for the run) while one more untimed run of blocks streams
through it, per --streams value, writes it to DIR and sums it into the shares
that say where the gateway's time goes (system calls, the scheduler, GC,
kvmesh's own code). --trace DIR takes an execution trace the same way and
reports what the gateway's goroutines waited for: how long wake-ups waited
for a thread, and for those that waited 1 ms or more, what ran on the
threads meanwhile and whether a GC was on.

kvmesh is built from ./cmd/kvmesh unless --kvmesh names a binary; nginx is
taken from PATH or /usr/sbin, installed with apt-get (nginx-light) when
missing and allowed, and left out (with a message) when it cannot be.`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), o.timeout)
			defer cancel()
			rep, err := runProxybench(ctx, o, stderr)
			if err != nil {
				return err
			}
			rep.write(stdout)
			if o.out != "" {
				b, _ := json.MarshalIndent(rep, "", "  ")
				if err := os.WriteFile(o.out, append(b, '\n'), 0o644); err != nil {
					return err
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.IntSliceVar(&o.streams, "streams", o.streams, "concurrent streams per block (one block per target per value per round)")
	f.IntVar(&o.perWorker, "per-worker", o.perWorker, "requests each worker sends per block")
	f.IntVar(&o.rounds, "rounds", o.rounds, "rounds (interleaved blocks per target) per --streams value")
	f.IntVar(&o.tokens, "tokens", o.tokens, "content events per answer (one more chunk carries usage and [DONE])")
	f.DurationVar(&o.gap, "gap", o.gap, "engine pause between chunks")
	f.IntVar(&o.prompt, "prompt", o.prompt, "prompt bytes")
	f.StringVar(&o.kvmesh, "kvmesh", "", "kvmesh binary (default: go build ./cmd/kvmesh into a temp dir)")
	f.StringVar(&o.baseline, "baseline-kvmesh", "", "a second kvmesh binary (e.g. built from main) measured in the same run as target kvmesh-baseline")
	f.BoolVar(&o.goFloor, "go-floor", false, "also measure target go-floor: net/http/httputil.ReverseProxy alone over the same engines (what any Go proxy costs on these cores)")
	f.BoolVar(&o.rawFloor, "raw-floor", false, "also measure target raw-floor: a Go proxy with no net/http on either side over the same engines (what the Go runtime alone costs on these cores)")
	f.IntVar(&o.procs, "kvmesh-gomaxprocs", 0, "GOMAXPROCS for the kvmesh target only (0: Go's default, one per core)")
	f.StringVar(&o.nginx, "nginx", "", "nginx binary (default: nginx from PATH or /usr/sbin/nginx)")
	f.BoolVar(&o.noInstall, "no-install", false, "do not apt-get install nginx-light when nginx is missing")
	f.StringVar(&o.strategy, "strategy", o.strategy, "kvmesh --strategy")
	f.StringVar(&o.indexMode, "index-mode", o.indexMode, "kvmesh --index-mode")
	f.BoolVar(&o.strace, "strace", false, "also count syscalls per 1,000 requests with strace -c -f (one extra untimed block per proxy)")
	f.StringVar(&o.profile, "profile", "", "also take a CPU profile of each kvmesh target from its /debug/pprof/ at each --streams value (one extra untimed run of blocks) and write it into this directory")
	f.IntVar(&o.profSecs, "profile-seconds", o.profSecs, "length of each --profile")
	f.StringVar(&o.trace, "trace", "", "also take an execution trace of each kvmesh target from its /debug/pprof/ at each --streams value (one extra untimed run of blocks), write it into this directory and report what its goroutines waited for")
	f.IntVar(&o.traceSecs, "trace-seconds", o.traceSecs, "length of each --trace (a trace at 200 streams takes about 0.3 MB a second)")
	f.StringVar(&o.out, "out", "", "also write the figures as JSON to this file")
	f.DurationVar(&o.timeout, "timeout", o.timeout, "abort the whole run after this long")
	return cmd
}

// proc is a child process proxybench started.
type proc struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	pids  func() []int // processes whose CPU counts as this target's
}

func (p *proc) stop() {
	if p == nil || p.cmd.Process == nil {
		return
	}
	if p.stdin != nil {
		_ = p.stdin.Close()
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

// startEngine starts one engine process and returns it with its address.
func startEngine(ctx context.Context, o proxyOpts) (*proc, string, error) {
	return startChild(ctx, "engine", "proxybench-engine", "--tokens", strconv.Itoa(o.tokens), "--gap", o.gap.String())
}

// startChild starts this binary's hidden subcommand args[0] with the rest
// of args, which prints "listening ADDR" and serves until its stdin
// closes; it returns the process and ADDR.
func startChild(ctx context.Context, name string, args ...string) (*proc, string, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, "", err
	}
	cmd := exec.CommandContext(ctx, self, args...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, "", err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, "", err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, "", err
	}
	p := &proc{name: name, cmd: cmd, stdin: stdin}
	p.pids = func() []int { return []int{cmd.Process.Pid} }
	line, err := bufio.NewReader(out).ReadString('\n')
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "listening ")
	if err != nil || !ok {
		p.stop()
		return nil, "", fmt.Errorf("%s did not start: %q %v", name, line, err)
	}
	go func() { _, _ = io.Copy(io.Discard, out) }()
	return p, addr, nil
}

// freePort returns a loopback port nothing listens on right now.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// findNginx returns an nginx binary, installing Debian's nginx-light when
// none is found and installing is allowed; "" with a reason otherwise.
func findNginx(ctx context.Context, o proxyOpts, log io.Writer) (string, string) {
	if o.nginx != "" {
		return o.nginx, ""
	}
	look := func() string {
		if p, err := exec.LookPath("nginx"); err == nil {
			return p
		}
		if _, err := os.Stat("/usr/sbin/nginx"); err == nil {
			return "/usr/sbin/nginx"
		}
		return ""
	}
	if p := look(); p != "" {
		return p, ""
	}
	if o.noInstall {
		return "", "nginx not found and --no-install given"
	}
	if os.Geteuid() != 0 {
		return "", "nginx not found and not root: install it with `apt-get install -y nginx-light`"
	}
	fmt.Fprintln(log, "proxybench: nginx not found, installing nginx-light with apt-get")
	for _, args := range [][]string{{"update", "-qq"}, {"install", "-y", "-qq", "nginx-light"}} {
		c := exec.CommandContext(ctx, "apt-get", args...)
		c.Stdout, c.Stderr = log, log
		c.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if err := c.Run(); err != nil {
			return "", fmt.Sprintf("apt-get %s failed: %v", args[0], err)
		}
	}
	if p := look(); p != "" {
		return p, ""
	}
	return "", "apt-get installed nginx-light but no nginx binary was found"
}

// nginxConf is the baseline: one worker, upstream keep-alive, no response
// buffering (each chunk is passed on as it arrives), no access log.
func nginxConf(dir string, port int, engines []string) string {
	var ups strings.Builder
	for _, e := range engines {
		fmt.Fprintf(&ups, "    server %s;\n", e)
	}
	user := ""
	if os.Geteuid() == 0 {
		user = "user root;\n"
	}
	return fmt.Sprintf(`%sdaemon off;
master_process on;
worker_processes 1;
pid %[2]s/nginx.pid;
error_log %[2]s/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path %[2]s/body;
  proxy_temp_path %[2]s/proxy;
  fastcgi_temp_path %[2]s/fastcgi;
  uwsgi_temp_path %[2]s/uwsgi;
  scgi_temp_path %[2]s/scgi;
  client_max_body_size 32m;
  client_body_buffer_size 64k;
  upstream engines {
%[3]s    keepalive 512;
  }
  server {
    listen 127.0.0.1:%[4]d;
    location / {
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering on;
    }
  }
}
`, user, dir, ups.String(), port)
}

// childPIDs lists the processes whose parent is pid.
func childPIDs(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		c, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, err := readStat(c); err == nil && st.ppid == pid {
			out = append(out, c)
		}
	}
	return out
}

type procStat struct {
	ppid  int
	ticks int64 // utime + stime, all threads
}

// readStat reads /proc/pid/stat (fields after the parenthesised name).
func readStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, errors.New("bad stat")
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
	if len(f) < 13 {
		return procStat{}, errors.New("short stat")
	}
	ppid, _ := strconv.Atoi(f[1])
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return procStat{ppid: ppid, ticks: ut + st}, nil
}

// clkTck is USER_HZ: 100 on every Linux architecture Go runs on.
const clkTck = 100

// ctxSwitches sums the voluntary and involuntary context switches of every
// thread of pids (/proc/pid/task/*/status): each is a thread going to
// sleep or being put off the CPU, the cost a busy small machine pays most.
func ctxSwitches(pids []int) int64 {
	var n int64
	for _, p := range pids {
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", p))
		for _, t := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", p, t.Name()))
			if err != nil {
				continue
			}
			for _, l := range strings.Split(string(b), "\n") {
				if v, ok := strings.CutPrefix(l, "voluntary_ctxt_switches:"); ok {
					x, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
					n += x
				} else if v, ok := strings.CutPrefix(l, "nonvoluntary_ctxt_switches:"); ok {
					x, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
					n += x
				}
			}
		}
	}
	return n
}

func cpuTicks(pids []int) int64 {
	var t int64
	for _, p := range pids {
		if st, err := readStat(p); err == nil {
			t += st.ticks
		}
	}
	return t
}

// waitHTTP polls url until it answers want or ctx ends.
func waitHTTP(ctx context.Context, url string, want int) error {
	c := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := c.Get(url)
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == want {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not answer %d within 30s (last: %v)", url, want, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// target is one path the load generator measures.
type target struct {
	name   string
	urls   []string // round-robin
	client *http.Client
	proc   *proc  // nil for direct
	gcURL  string // kvmesh's /metrics, read for its GC cycle count
	base   string // kvmesh's base URL (its /debug/pprof/), "" for the others
}

// readGoRuntime reads a Go process's GC cycles and scheduling latency
// histogram (how long goroutines that were ready to run waited for a
// thread) from its Prometheus /metrics; false when it cannot.
func readGoRuntime(url string) (gosched.Runtime, bool) {
	if url == "" {
		return gosched.Runtime{}, false
	}
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return gosched.Runtime{}, false
	}
	defer resp.Body.Close()
	rt, err := gosched.Parse(resp.Body)
	return rt, err == nil && rt.GCs >= 0
}

// sample is what one block measured for one target.
type sample struct {
	ttfb, gaps []time.Duration
	requests   int
	ticks      int64
	loadTicks  int64             // CPU ticks of this process (the load generator) during the block
	switches   int64             // context switches of the target's threads
	gcs        int64             // GC cycles (kvmesh only; -1 unknown)
	sched      gosched.Histogram // scheduling latency histogram (kvmesh only; nil unknown)
	failures   int
	firstErr   error
}

// runBlock runs conc workers, each sending perWorker requests to t back to
// back; worker i starts after i·stagger.
func runBlock(ctx context.Context, t *target, bodies func(int) []byte, want []byte, conc, perWorker int, stagger time.Duration) sample {
	var (
		mu  sync.Mutex
		s   sample
		wg  sync.WaitGroup
		seq int
	)
	var pids []int
	if t.proc != nil {
		pids = t.proc.pids()
	}
	rt0, rtOK := readGoRuntime(t.gcURL)
	self := []int{os.Getpid()}
	t0, sw0, l0 := cpuTicks(pids), ctxSwitches(pids), cpuTicks(self)
	for i := 0; i < conc; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select { // pacing the load, not waiting for a condition
			case <-time.After(time.Duration(i) * stagger):
			case <-ctx.Done():
				return
			}
			var ttfb []time.Duration
			var gaps []time.Duration
			fails := 0
			var ferr error
			for k := 0; k < perWorker && ctx.Err() == nil; k++ {
				mu.Lock()
				n := seq
				seq++
				mu.Unlock()
				d, g, err := streamOnce(ctx, t.client, t.urls[n%len(t.urls)], bodies(n), want, gaps)
				if err != nil {
					fails++
					if ferr == nil {
						ferr = err
					}
					continue
				}
				ttfb, gaps = append(ttfb, d), g
			}
			mu.Lock()
			s.ttfb = append(s.ttfb, ttfb...)
			s.gaps = append(s.gaps, gaps...)
			s.requests += len(ttfb) + fails
			s.failures += fails
			if s.firstErr == nil {
				s.firstErr = ferr
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	s.ticks = cpuTicks(pids) - t0
	s.loadTicks = cpuTicks(self) - l0
	s.switches = ctxSwitches(pids) - sw0
	s.gcs = -1
	if rt1, ok := readGoRuntime(t.gcURL); rtOK && ok {
		s.gcs = rt1.GCs - rt0.GCs
		s.sched = rt1.Sched.Sub(rt0.Sched)
	}
	return s
}

// streamOnce sends one streaming completion, returns its TTFB (request
// sent to first body byte) and appends the gaps between consecutive reads
// that completed SSE events (the chunks as the client sees them); the body
// must equal want.
func streamOnce(ctx context.Context, c *http.Client, url string, body, want []byte, gaps []time.Duration) (time.Duration, []time.Duration, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return 0, gaps, err
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return 0, gaps, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, resp.Body)
		return 0, gaps, fmt.Errorf("status %d", resp.StatusCode)
	}
	var (
		buf   [8 << 10]byte
		off   int
		ttfb  time.Duration
		last  time.Time
		nl    bool // previous byte was '\n'
		first = true
	)
	for {
		n, rerr := resp.Body.Read(buf[:])
		if n > 0 {
			now := time.Now()
			if first {
				ttfb, first = now.Sub(start), false
			}
			if off+n > len(want) || !bytes.Equal(buf[:n], want[off:off+n]) {
				return 0, gaps, fmt.Errorf("body differs from the engine's stream at byte %d", off)
			}
			off += n
			ended := false // an event ended in this read
			for _, b := range buf[:n] {
				ended = ended || (b == '\n' && nl)
				nl = b == '\n'
			}
			// One gap per arrival of events, not per event: events that
			// arrive together were sent together.
			if ended {
				if !last.IsZero() {
					gaps = append(gaps, now.Sub(last))
				}
				last = now
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return 0, gaps, rerr
		}
	}
	if off != len(want) {
		return 0, gaps, fmt.Errorf("body of %d bytes, want %d", off, len(want))
	}
	return ttfb, gaps, nil
}

// pct is the p-quantile of sorted by linear interpolation between ranks.
func pct(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	pos := p * float64(len(sorted)-1)
	lo := int(pos)
	if lo+1 >= len(sorted) {
		return sorted[len(sorted)-1]
	}
	frac := pos - float64(lo)
	return sorted[lo] + time.Duration(math.Round(frac*float64(sorted[lo+1]-sorted[lo])))
}

// proxyRow is one target's figures at one stream count.
type proxyRow struct {
	Target      string  `json:"target"`
	Streams     int     `json:"streams"`
	Requests    int     `json:"requests"`
	Failures    int     `json:"failures"`
	TTFBp50ms   float64 `json:"ttfb_p50_ms"`
	TTFBp99ms   float64 `json:"ttfb_p99_ms"`
	AddedP50ms  float64 `json:"added_ttfb_p50_ms"`
	AddedP99ms  float64 `json:"added_ttfb_p99_ms"`
	GapP50ms    float64 `json:"gap_p50_ms"`
	GapP99ms    float64 `json:"gap_p99_ms"`
	AddedGapP99 float64 `json:"added_gap_p99_ms"`
	CPUPer1000s float64 `json:"cpu_s_per_1000"` // -1 for direct
	// LoadCPU1000s is the load generator's (this process's) CPU seconds
	// per 1,000 requests during the target's blocks: on shared cores its
	// work competes with the proxy's.
	LoadCPU1000s float64   `json:"load_generator_cpu_s_per_1000"`
	Switches1000 float64   `json:"context_switches_per_1000"`
	GC1000       float64   `json:"gc_cycles_per_1000,omitempty"` // kvmesh only
	Sched        *schedRow `json:"sched,omitempty"`              // kvmesh only
	Syscalls1000 float64   `json:"syscalls_per_1000,omitempty"`
	FirstError   string    `json:"first_error,omitempty"`
}

// schedRow is how long kvmesh's ready goroutines waited for a thread
// (go_sched_latencies_seconds): what its latency is made of beyond its
// own work when the cores are short.
type schedRow struct {
	Samples       float64 `json:"samples"`        // wake-ups the runtime sampled (about one in eight)
	Over1msShare  float64 `json:"over_1ms_share"` // of wake-ups, waiting longer than Over1msBound
	Over1msBound  float64 `json:"over_1ms_bound_s"`
	Over10msShare float64 `json:"over_10ms_share"`
	Over10msBound float64 `json:"over_10ms_bound_s"`
}

// proxyReport is a whole run.
type proxyReport struct {
	UptimeBefore string          `json:"uptime_before"`
	UptimeAfter  string          `json:"uptime_after"`
	Options      string          `json:"options"`
	NginxMissing string          `json:"nginx_missing,omitempty"`
	Rows         []proxyRow      `json:"rows"`
	Syscalls     []string        `json:"syscalls,omitempty"` // strace -c tables
	Profiles     []profileResult `json:"profiles,omitempty"`
	Traces       []traceResult   `json:"traces,omitempty"`
	Bands        []proxyBands    `json:"bands"`
}

func uptime() string {
	b, err := exec.Command("uptime").Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(b))
}

func runProxybench(ctx context.Context, o proxyOpts, log io.Writer) (*proxyReport, error) {
	if o.rounds < 1 || o.perWorker < 1 || o.tokens < 1 || len(o.streams) == 0 {
		return nil, errors.New("--rounds, --per-worker, --tokens and --streams must be positive")
	}
	if o.profile != "" && o.profSecs < 1 {
		return nil, errors.New("--profile-seconds must be positive")
	}
	if o.trace != "" && o.traceSecs < 1 {
		return nil, errors.New("--trace-seconds must be positive")
	}
	for _, s := range o.streams {
		if s < 1 || s > 2000 {
			return nil, fmt.Errorf("--streams %d out of 1..2000", s)
		}
	}
	dir, err := os.MkdirTemp("", "proxybench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	rep := &proxyReport{UptimeBefore: uptime(), Options: fmt.Sprintf("streams=%v per-worker=%d rounds=%d tokens=%d gap=%s prompt=%dB strategy=%s index-mode=%s kvmesh-gomaxprocs=%d baseline=%q go-floor=%t raw-floor=%t",
		o.streams, o.perWorker, o.rounds, o.tokens, o.gap, o.prompt, o.strategy, o.indexMode, o.procs, o.baseline, o.goFloor, o.rawFloor)}

	kvBin := o.kvmesh
	if kvBin == "" {
		kvBin = filepath.Join(dir, "kvmesh")
		fmt.Fprintln(log, "proxybench: building ./cmd/kvmesh")
		b := exec.CommandContext(ctx, "go", "build", "-o", kvBin, "./cmd/kvmesh")
		b.Stdout, b.Stderr = log, log
		if err := b.Run(); err != nil {
			return nil, fmt.Errorf("go build ./cmd/kvmesh (run from the repository root or pass --kvmesh): %w", err)
		}
	}
	ngBin, missing := findNginx(ctx, o, log)
	if missing != "" {
		fmt.Fprintln(log, "proxybench: running without nginx:", missing)
		rep.NginxMissing = missing
	}

	var procs []*proc
	defer func() {
		for _, p := range procs {
			p.stop()
		}
	}()
	var engines []string
	for range 2 {
		p, addr, err := startEngine(ctx, o)
		if err != nil {
			return nil, err
		}
		procs = append(procs, p)
		engines = append(engines, addr)
	}
	maxConc := slices.Max(o.streams)
	newClient := func() *http.Client {
		return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * maxConc, MaxIdleConns: 4 * maxConc,
			DisableCompression: true, IdleConnTimeout: time.Minute}}
	}
	direct := &target{name: targetDirect, client: newClient()}
	for _, e := range engines {
		direct.urls = append(direct.urls, "http://"+e+"/v1/completions")
	}
	targets := []*target{direct}

	if ngBin != "" {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		conf := filepath.Join(dir, "nginx.conf")
		if err := os.WriteFile(conf, []byte(nginxConf(dir, port, engines)), 0o644); err != nil {
			return nil, err
		}
		cmd := exec.CommandContext(ctx, ngBin, "-c", conf, "-p", dir, "-e", filepath.Join(dir, "error.log"))
		cmd.Stdout, cmd.Stderr = log, log
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("start nginx: %w", err)
		}
		p := &proc{name: targetNginx, cmd: cmd}
		p.pids = func() []int { return append([]int{cmd.Process.Pid}, childPIDs(cmd.Process.Pid)...) }
		procs = append(procs, p)
		url := fmt.Sprintf("http://127.0.0.1:%d", port)
		if err := waitHTTP(ctx, url+"/health", http.StatusOK); err != nil {
			b, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			return nil, fmt.Errorf("nginx: %w\n%s", err, b)
		}
		targets = append(targets, &target{name: targetNginx, urls: []string{url + "/v1/completions"}, client: newClient(), proc: p})
	}

	for _, fl := range []struct {
		on        bool
		name, cmd string
		scheme    string
	}{{o.goFloor, targetGoFloor, "proxybench-gofloor", "http://"}, {o.rawFloor, targetRawFloor, "proxybench-rawfloor", ""}} {
		if !fl.on {
			continue
		}
		args := []string{fl.cmd}
		for _, e := range engines {
			args = append(args, "--upstream", fl.scheme+e)
		}
		p, addr, err := startChild(ctx, fl.name, args...)
		if err != nil {
			return nil, err
		}
		procs = append(procs, p)
		targets = append(targets, &target{name: fl.name, urls: []string{"http://" + addr + "/v1/completions"}, client: newClient(), proc: p})
	}

	// An admin token opens the gateways' /debug/pprof/ to --profile and
	// --trace.
	token := ""
	if o.profile != "" || o.trace != "" {
		if token, err = newAdminToken(); err != nil {
			return nil, err
		}
	}
	for _, dir := range []string{o.profile, o.trace} {
		if dir == "" {
			continue
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
	}
	for _, k := range []struct{ name, bin string }{{targetKvmesh, kvBin}, {targetBaseline, o.baseline}} {
		if k.bin == "" {
			continue
		}
		t, err := startKvmesh(ctx, k.name, k.bin, token, o, engines, log)
		if t != nil {
			procs = append(procs, t.proc)
		}
		if err != nil {
			return nil, err
		}
		t.client = newClient()
		targets = append(targets, t)
	}

	var want []byte
	for _, c := range benchStream(o.tokens) {
		want = append(want, c...)
	}
	// Prompts share a prefix and end with the request number, so that
	// the index sees both hits and misses.
	prefix := strings.Repeat("The quick brown fox jumps over the lazy dog. ", o.prompt/45+1)[:o.prompt*3/4]
	bodies := func(n int) []byte {
		p := fmt.Sprintf("%s request %d %s", prefix, n, strings.Repeat("x", max(0, o.prompt-len(prefix)-20)))
		b, _ := json.Marshal(map[string]any{"model": "M", "prompt": p, "max_tokens": o.tokens, "stream": true,
			"stream_options": map[string]bool{"include_usage": true}})
		return b
	}
	streamDur := time.Duration(o.tokens) * o.gap
	for _, t := range targets { // warm the connection pools and code paths
		if s := runBlock(ctx, t, bodies, want, maxConc, 1, 0); s.failures > 0 {
			return nil, fmt.Errorf("%s warm-up: %d of %d failed: %v", t.name, s.failures, s.requests, s.firstErr)
		}
	}

	for _, conc := range o.streams {
		acc := map[string]*sample{}
		byRound := map[string][]blockTimes{}
		stagger := streamDur / time.Duration(conc)
		for r := 0; r < o.rounds; r++ {
			for i := range targets {
				t := targets[(i+r)%len(targets)]
				s := runBlock(ctx, t, bodies, want, conc, o.perWorker, stagger)
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				byRound[t.name] = append(byRound[t.name], blockTimes{ttfb: s.ttfb, gaps: s.gaps})
				a := acc[t.name]
				if a == nil {
					a = &sample{sched: gosched.Histogram{}}
					acc[t.name] = a
				}
				a.ttfb, a.gaps = append(a.ttfb, s.ttfb...), append(a.gaps, s.gaps...)
				a.requests += s.requests
				a.failures += s.failures
				a.ticks += s.ticks
				a.loadTicks += s.loadTicks
				a.switches += s.switches
				if s.gcs >= 0 {
					a.gcs += s.gcs
				}
				for le, n := range s.sched {
					a.sched[le] += n
				}
				if a.firstErr == nil {
					a.firstErr = s.firstErr
				}
			}
		}
		d := acc[targetDirect]
		slices.Sort(d.ttfb)
		slices.Sort(d.gaps)
		for _, t := range targets {
			a := acc[t.name]
			slices.Sort(a.ttfb)
			slices.Sort(a.gaps)
			row := proxyRow{Target: t.name, Streams: conc, Requests: a.requests, Failures: a.failures,
				TTFBp50ms: ms(pct(a.ttfb, .5)), TTFBp99ms: ms(pct(a.ttfb, .99)),
				GapP50ms: ms(pct(a.gaps, .5)), GapP99ms: ms(pct(a.gaps, .99)), CPUPer1000s: -1}
			row.AddedP50ms = row.TTFBp50ms - ms(pct(d.ttfb, .5))
			row.AddedP99ms = row.TTFBp99ms - ms(pct(d.ttfb, .99))
			row.AddedGapP99 = row.GapP99ms - ms(pct(d.gaps, .99))
			if a.requests > 0 {
				row.LoadCPU1000s = per1000(float64(a.loadTicks)/clkTck, a.requests)
			}
			if t.proc != nil && a.requests > 0 {
				row.CPUPer1000s = per1000(float64(a.ticks)/clkTck, a.requests)
				row.Switches1000 = per1000(float64(a.switches), a.requests)
				if t.gcURL != "" {
					row.GC1000 = per1000(float64(a.gcs), a.requests)
				}
				if w := a.sched.Waits(); w.Wakeups > 0 {
					row.Sched = &schedRow{Samples: w.Wakeups,
						Over1msShare: w.Over1, Over1msBound: w.Bound1, Over10msShare: w.Over10, Over10msBound: w.Bound10}
				}
			}
			if a.firstErr != nil {
				row.FirstError = a.firstErr.Error()
			}
			rep.Rows = append(rep.Rows, row)
		}
		rep.Bands = append(rep.Bands, roundBands(conc, byRound, bandResamples))
	}

	if o.strace {
		conc := o.streams[0]
		for _, t := range targets[1:] {
			calls, table, err := straceBlock(ctx, t, bodies, want, conc, o.perWorker, streamDur/time.Duration(conc))
			if err != nil {
				fmt.Fprintf(log, "proxybench: strace of %s: %v\n", t.name, err)
				continue
			}
			rep.Syscalls = append(rep.Syscalls, fmt.Sprintf("%s, %d streams:\n%s", t.name, conc, table))
			for i := range rep.Rows {
				if rep.Rows[i].Target == t.name && rep.Rows[i].Streams == conc {
					rep.Rows[i].Syscalls1000 = calls
				}
			}
		}
	}
	// --profile and --trace: one more untimed run of blocks per capture,
	// per kvmesh target (t.base set) and stream count.
	for _, conc := range o.streams {
		stagger := streamDur / time.Duration(conc)
		for _, t := range targets {
			if t.base == "" {
				continue
			}
			if o.profile != "" {
				p := profileBlock(ctx, t, token, o.profSecs, o.profile, bodies, want, conc, o.perWorker, stagger)
				if p.Error != "" {
					fmt.Fprintf(log, "proxybench: profile of %s at %d streams: %s\n", t.name, conc, p.Error)
				}
				rep.Profiles = append(rep.Profiles, p)
			}
			if o.trace != "" {
				tr := traceBlock(ctx, t, token, o.traceSecs, o.trace, bodies, want, conc, o.perWorker, stagger)
				if tr.Error != "" {
					fmt.Fprintf(log, "proxybench: trace of %s at %d streams: %s\n", t.name, conc, tr.Error)
				}
				rep.Traces = append(rep.Traces, tr)
			}
		}
	}
	rep.UptimeAfter = uptime()
	return rep, nil
}

// startKvmesh starts `kvmesh serve` from bin in front of engines and waits
// until it is ready.
// token, when set, is its admin token (in its environment, not its
// command line).
func startKvmesh(ctx context.Context, name, bin, token string, o proxyOpts, engines []string, log io.Writer) (*target, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	kvAddr := fmt.Sprintf("127.0.0.1:%d", port)
	args := []string{"serve", "--http-addr", kvAddr, "--model", "M", "--strategy", o.strategy,
		"--index-mode", o.indexMode, "--log-level", "warn", "--tokenizer", "character"}
	for i, e := range engines {
		args = append(args, "--replica", fmt.Sprintf("e%d=http://%s", i, e))
	}
	kc := exec.CommandContext(ctx, bin, args...)
	kc.Stdout, kc.Stderr = log, log
	kc.Env = os.Environ()
	if name == targetKvmesh && o.procs > 0 {
		kc.Env = append(kc.Env, fmt.Sprintf("GOMAXPROCS=%d", o.procs))
	}
	if token != "" {
		kc.Env = append(kc.Env, "KVMESH_ADMIN_TOKEN="+token)
	}
	if err := kc.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	kp := &proc{name: name, cmd: kc}
	kp.pids = func() []int { return []int{kc.Process.Pid} }
	t := &target{name: name, urls: []string{"http://" + kvAddr + "/v1/completions"}, proc: kp, gcURL: "http://" + kvAddr + "/metrics", base: "http://" + kvAddr}
	if err := waitHTTP(ctx, "http://"+kvAddr+"/ready", http.StatusOK); err != nil {
		return t, fmt.Errorf("%s: %w", name, err)
	}
	return t, nil
}

// straceBlock runs one block with strace -c -f attached to the target's
// processes and returns syscalls per 1,000 requests and strace's table.
func straceBlock(ctx context.Context, t *target, bodies func(int) []byte, want []byte, conc, perWorker int, stagger time.Duration) (float64, string, error) {
	bin, err := exec.LookPath("strace")
	if err != nil {
		return 0, "", errors.New("strace not found (apt-get install -y strace)")
	}
	out, err := os.CreateTemp("", "proxybench-strace-")
	if err != nil {
		return 0, "", err
	}
	out.Close()
	defer os.Remove(out.Name())
	args := []string{"-c", "-f", "-q", "-o", out.Name()}
	for _, p := range t.proc.pids() {
		args = append(args, "-p", strconv.Itoa(p))
	}
	st := exec.CommandContext(ctx, bin, args...)
	if err := st.Start(); err != nil {
		return 0, "", err
	}
	// strace attaches asynchronously; a short warm block lets it settle.
	runBlock(ctx, t, bodies, want, conc, 1, 0)
	s := runBlock(ctx, t, bodies, want, conc, perWorker, stagger)
	_ = st.Process.Signal(os.Interrupt)
	_ = st.Wait()
	b, err := os.ReadFile(out.Name())
	if err != nil {
		return 0, "", err
	}
	total := 0
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) >= 4 && f[len(f)-1] == "total" {
			total, _ = strconv.Atoi(f[3])
		}
	}
	// The warm block's conc requests were traced too.
	n := s.requests + conc
	return float64(total) / float64(n) * 1000, string(b), nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// per1000 is x per 1,000 of requests (> 0).
func per1000(x float64, requests int) float64 { return x / float64(requests) * 1000 }

// writeLoadCPU prints, per stream count, the load generator's CPU per
// 1,000 requests during each target's blocks: it shares the cores with
// the proxies, so a heavier client leaves them less.
func (r *proxyReport) writeLoadCPU(w io.Writer) {
	for i := 0; i < len(r.Rows); {
		streams := r.Rows[i].Streams
		var parts []string
		for ; i < len(r.Rows) && r.Rows[i].Streams == streams; i++ {
			parts = append(parts, fmt.Sprintf("%s %.3f", r.Rows[i].Target, r.Rows[i].LoadCPU1000s))
		}
		fmt.Fprintf(w, "load generator (this process) at %d streams, CPU s per 1,000 requests during each target's blocks: %s\n", streams, strings.Join(parts, ", "))
	}
}

func (r *proxyReport) write(w io.Writer) {
	fmt.Fprintf(w, "proxybench: %s\n", r.Options)
	fmt.Fprintf(w, "uptime before: %s\nuptime after:  %s\n", r.UptimeBefore, r.UptimeAfter)
	if r.NginxMissing != "" {
		fmt.Fprintf(w, "nginx left out: %s\n", r.NginxMissing)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| streams | target | requests | fail | TTFB p50 / p99 ms | added p50 / p99 ms | gap p50 / p99 ms | added gap p99 ms | CPU s / 1000 req | ctx switches / 1000 req | syscalls / 1000 req |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|")
	for _, x := range r.Rows {
		cpu, cs, sc := "-", "-", "-"
		if x.CPUPer1000s >= 0 {
			cpu = fmt.Sprintf("%.3f", x.CPUPer1000s)
			cs = fmt.Sprintf("%.0f", x.Switches1000)
		}
		if x.Syscalls1000 > 0 {
			sc = fmt.Sprintf("%.0f", x.Syscalls1000)
		}
		fmt.Fprintf(w, "| %d | %s | %d | %d | %.2f / %.2f | %+.2f / %+.2f | %.2f / %.2f | %+.2f | %s | %s | %s |\n",
			x.Streams, x.Target, x.Requests, x.Failures, x.TTFBp50ms, x.TTFBp99ms, x.AddedP50ms, x.AddedP99ms,
			x.GapP50ms, x.GapP99ms, x.AddedGapP99, cpu, cs, sc)
	}
	r.writeLoadCPU(w)
	for _, x := range r.Rows {
		if strings.HasPrefix(x.Target, targetKvmesh) {
			fmt.Fprintf(w, "%s at %d streams: %.1f GC cycles per 1,000 requests", x.Target, x.Streams, x.GC1000)
			if sr := x.Sched; sr != nil {
				fmt.Fprintf(w, "; of its goroutine wake-ups (%.0f sampled), %.2f %% waited over %.2f ms for a thread, %.3f %% over %.1f ms",
					sr.Samples, 100*sr.Over1msShare, 1e3*sr.Over1msBound, 100*sr.Over10msShare, 1e3*sr.Over10msBound)
			}
			fmt.Fprintln(w)
		}
	}
	for _, x := range r.Rows {
		if x.FirstError != "" {
			fmt.Fprintf(w, "first error, %s at %d streams: %s\n", x.Target, x.Streams, x.FirstError)
		}
	}
	// Issue 21's acceptance, per stream count.
	by := map[[2]any]proxyRow{}
	var streams []int
	for _, x := range r.Rows {
		by[[2]any{x.Streams, x.Target}] = x
		if !slices.Contains(streams, x.Streams) {
			streams = append(streams, x.Streams)
		}
	}
	fmt.Fprintln(w)
	for _, s := range streams {
		k, okK := by[[2]any{s, targetKvmesh}]
		ng, okN := by[[2]any{s, targetNginx}]
		if !okK {
			continue
		}
		verdict := func(ok bool) string {
			if ok {
				return "ok"
			}
			return "NOT MET"
		}
		if okN {
			fmt.Fprintf(w, "%d streams: added TTFB p50 %.2f <= nginx %.2f + 0.5: %s; p99 %.2f <= nginx %.2f + 0.5: %s; CPU/1000 %.3f <= 2 x nginx %.3f: %s\n",
				s, k.AddedP50ms, ng.AddedP50ms, verdict(k.AddedP50ms <= ng.AddedP50ms+0.5),
				k.AddedP99ms, ng.AddedP99ms, verdict(k.AddedP99ms <= ng.AddedP99ms+0.5),
				k.CPUPer1000s, ng.CPUPer1000s, verdict(k.CPUPer1000s <= 2*ng.CPUPer1000s))
		}
		fmt.Fprintf(w, "%d streams: kvmesh added inter-chunk gap p99 %.2f ms <= 0.2: %s\n", s, k.AddedGapP99, verdict(k.AddedGapP99 <= 0.2))
	}
	for _, b := range r.Bands {
		b.write(w)
	}
	for _, t := range r.Syscalls {
		fmt.Fprintf(w, "\nstrace -c -f, %s\n", t)
	}
	for _, p := range r.Profiles {
		p.write(w)
	}
	for _, t := range r.Traces {
		t.write(w)
	}
}
