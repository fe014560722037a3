package sim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// HeaderDataParallelRank is the request header vLLM's API server reads to
// send a request to one data-parallel rank (OpenAIServing.
// _get_data_parallel_rank in vllm/entrypoints/openai): an int, the rank.
const HeaderDataParallelRank = "X-data-parallel-rank"

// Serving is a running simulator: one engine (Server) or a data-parallel
// group of them (DPServer).
type Serving interface {
	Start(ctx context.Context) error
	Shutdown(ctx context.Context) error
	// Addr is the HTTP listen address ("" before Start); URL is
	// "http://" + Addr.
	Addr() string
	URL() string
	// KVEventsAddr and KVReplayAddr are the bound ZMQ addresses of rank
	// 0 (or the only engine), "" when none.
	KVEventsAddr() string
	KVReplayAddr() string
}

var (
	_ Serving = (*Server)(nil)
	_ Serving = (*DPServer)(nil)
)

// NewServing returns a DPServer when cfg.DataParallelSize > 1, else a
// Server.
func NewServing(cfg Config) (Serving, error) {
	if cfg.DataParallelSize > 1 {
		return NewDPServer(cfg)
	}
	return NewServer(cfg)
}

// DPServer is a vLLM server with data parallelism: N engines (ranks), each
// a Server with its own KV pool, scheduler and KV-event publisher, behind
// one HTTP address. As vLLM, rank r publishes on the configured KV-event
// (and replay) endpoint's port + r with data_parallel_rank r in every
// batch. A request carrying HeaderDataParallelRank goes to that rank
// (400 if out of range, as vLLM refuses it); any other goes to the rank
// with the fewest running plus waiting requests (vLLM's internal balancer
// ranks by its engines' queues too), the lowest rank on ties. /metrics
// concatenates every rank's exposition (a scraper sums the series, as
// over vLLM's per-engine series); POST /reset_prefix_cache resets every
// rank; other GETs go to rank 0.
type DPServer struct {
	cfg   Config
	ranks []*Server
	ln    net.Listener
	http  *http.Server
	// proxies[r] forwards to rank r's own listener.
	proxies []*httputil.ReverseProxy
	routed  []atomic.Uint64
	done    chan error
}

// offsetEndpoint raises a tcp:// ZMQ endpoint's port by r (vLLM's
// per-rank offset); "" stays "".
func offsetEndpoint(ep string, r int) (string, error) {
	if ep == "" || r == 0 {
		return ep, nil
	}
	rest, ok := strings.CutPrefix(ep, "tcp://")
	host, port, err := net.SplitHostPort(rest)
	p, perr := strconv.Atoi(port)
	if !ok || err != nil || perr != nil || p == 0 || p+r > 65535 {
		return "", fmt.Errorf("%w: data-parallel KV endpoint %q must be tcp://host:port with a fixed port", ErrInvalidConfig, ep)
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+r)), nil
}

// NewDPServer builds cfg.DataParallelSize ranks from cfg; each rank's
// HTTP listener is internal (127.0.0.1, an ephemeral port).
func NewDPServer(cfg Config) (*DPServer, error) {
	n := cfg.DataParallelSize
	if n < 2 {
		return nil, fmt.Errorf("%w: a DPServer needs a data-parallel size >= 2, not %d", ErrInvalidConfig, n)
	}
	if cfg.Publisher != nil {
		return nil, fmt.Errorf("%w: a DPServer builds one publisher per rank (Config.Publisher unset)", ErrInvalidConfig)
	}
	d := &DPServer{cfg: cfg, routed: make([]atomic.Uint64, n), done: make(chan error, 1)}
	for r := range n {
		c := cfg
		c.Host, c.Port, c.DataParallelRank = "127.0.0.1", 0, r
		var err error
		if c.KVEvents.Endpoint, err = offsetEndpoint(cfg.KVEvents.Endpoint, r); err != nil {
			return nil, err
		}
		if c.KVEvents.ReplayEndpoint, err = offsetEndpoint(cfg.KVEvents.ReplayEndpoint, r); err != nil {
			return nil, err
		}
		if cfg.Logger != nil {
			c.Logger = cfg.Logger.With("dp_rank", r)
		}
		s, err := NewServer(c)
		if err != nil {
			return nil, err
		}
		d.ranks = append(d.ranks, s)
	}
	return d, nil
}

// Start starts every rank, then the front listener.
func (d *DPServer) Start(ctx context.Context) error {
	for i, s := range d.ranks {
		if err := s.Start(ctx); err != nil {
			d.shutdownRanks(i)
			return err
		}
		u, _ := url.Parse(s.URL())
		p := httputil.NewSingleHostReverseProxy(u)
		p.FlushInterval = -1 // stream tokens as they come
		d.proxies = append(d.proxies, p)
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", d.cfg.listenAddr())
	if err != nil {
		d.shutdownRanks(len(d.ranks))
		return fmt.Errorf("sim: listen: %w", err)
	}
	d.ln = ln
	d.http = &http.Server{Handler: d, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := d.http.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			d.done <- err
		}
	}()
	return nil
}

func (d *DPServer) shutdownRanks(n int) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, s := range d.ranks[:n] {
		_ = s.Shutdown(ctx)
	}
}

// Shutdown stops the front listener, then every rank.
func (d *DPServer) Shutdown(ctx context.Context) error {
	var errs []error
	if d.http != nil {
		if err := d.http.Shutdown(ctx); err != nil {
			errs = append(errs, err)
			_ = d.http.Close()
		}
	}
	for _, s := range d.ranks {
		if err := s.Shutdown(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	select {
	case err := <-d.done:
		errs = append(errs, err)
	default:
	}
	return errors.Join(errs...)
}

// Addr is the front HTTP address ("" before Start).
func (d *DPServer) Addr() string {
	if d.ln == nil {
		return ""
	}
	return d.ln.Addr().String()
}

// URL is "http://" + Addr().
func (d *DPServer) URL() string { return "http://" + d.Addr() }

// KVEventsAddr is rank 0's bound PUB address.
func (d *DPServer) KVEventsAddr() string { return d.ranks[0].KVEventsAddr() }

// KVReplayAddr is rank 0's bound replay address.
func (d *DPServer) KVReplayAddr() string { return d.ranks[0].KVReplayAddr() }

// Rank returns rank r's engine server (for tests and truth checks).
func (d *DPServer) Rank(r int) *Server { return d.ranks[r] }

// Size is the number of ranks.
func (d *DPServer) Size() int { return len(d.ranks) }

// Routed returns how many requests the front sent to rank r.
func (d *DPServer) Routed(r int) uint64 { return d.routed[r].Load() }

// pick returns the rank for a request: its header's, else the least
// loaded; ok false with a message when the header is invalid.
func (d *DPServer) pick(req *http.Request) (int, string) {
	if v := req.Header.Get(HeaderDataParallelRank); v != "" {
		r, err := strconv.Atoi(v)
		if err != nil || r < 0 || r >= len(d.ranks) {
			return -1, fmt.Sprintf("data_parallel_rank %q out of range [0, %d)", v, len(d.ranks))
		}
		return r, ""
	}
	best, load := 0, -1
	for r, s := range d.ranks {
		st := s.Stats()
		if l := st.Running + st.Waiting + st.Queued; load < 0 || l < load {
			best, load = r, l
		}
	}
	return best, ""
}

// ServeHTTP implements http.Handler (see DPServer).
func (d *DPServer) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	switch {
	case req.Method == http.MethodGet && req.URL.Path == "/metrics":
		d.metrics(w, req)
		return
	case req.Method == http.MethodPost && req.URL.Path == "/reset_prefix_cache":
		status := http.StatusOK
		for _, s := range d.ranks {
			if d.cfg.EnableResetEndpoint && !s.ResetPrefixCache() {
				status = http.StatusConflict
			}
		}
		if !d.cfg.EnableResetEndpoint {
			status = http.StatusNotFound
		}
		w.WriteHeader(status)
		return
	case req.Method != http.MethodPost:
		d.proxies[0].ServeHTTP(w, req)
		return
	}
	// The body is read whole before proxying: forwarded as a stream, it
	// let the front's transport close the rank's connection while the
	// response streamed back (clients saw unexpected EOF, about one stream
	// in 300 at four in flight; TestDPFrontStreamsConcurrently).
	body, err := io.ReadAll(http.MaxBytesReader(w, req.Body, maxBodyBytes))
	if err != nil {
		http.Error(w, err.Error(), http.StatusRequestEntityTooLarge)
		return
	}
	req.Body = io.NopCloser(bytes.NewReader(body))
	req.ContentLength = int64(len(body))
	r, msg := d.pick(req)
	if r < 0 {
		http.Error(w, msg, http.StatusBadRequest)
		return
	}
	d.routed[r].Add(1)
	d.proxies[r].ServeHTTP(w, req)
}

// metrics writes every rank's /metrics one after the other.
func (d *DPServer) metrics(w http.ResponseWriter, req *http.Request) {
	var buf bytes.Buffer
	for _, s := range d.ranks {
		mreq, err := http.NewRequestWithContext(req.Context(), http.MethodGet, s.URL()+"/metrics", nil)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		resp, err := http.DefaultClient.Do(mreq)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		_, err = io.Copy(&buf, resp.Body)
		resp.Body.Close()
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	_, _ = w.Write(buf.Bytes())
}
