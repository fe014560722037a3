package faultctl

import (
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"regexp"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvmesh/kvmesh/chaos/faultproxy"
)

// Proxy kinds.
const (
	KindTCP = "tcp"
	KindZMQ = "zmq"
)

// Fault types.
const (
	FaultLatency   = "latency"   // tcp
	FaultBandwidth = "bandwidth" // tcp
	FaultDrop      = "drop"      // tcp (bytes) and zmq (messages)
	FaultRefuse    = "refuse"    // tcp, link-wide
	FaultHold      = "hold"      // tcp, link-wide
	FaultDuplicate = "duplicate" // zmq
	FaultReorder   = "reorder"   // zmq
	FaultGarble    = "garble"    // zmq
)

// ProxySpec describes a proxy to create.
type ProxySpec struct {
	Name string `json:"name"`
	// Kind is "tcp" or "zmq".
	Kind string `json:"kind"`
	// Listen is where the proxy accepts: host:port for tcp, a ZMQ endpoint
	// (tcp://127.0.0.1:15557) for zmq. Port 0 picks a free one (see
	// ProxyInfo.Addr).
	Listen string `json:"listen"`
	// Upstream is the target host:port (tcp) or the PUB endpoint to
	// subscribe to (zmq).
	Upstream string `json:"upstream"`
}

// FaultSpec describes a fault to add. Fields that do not apply to the
// type must be zero.
type FaultSpec struct {
	// Name identifies the fault on its proxy; default type[-direction].
	Name string `json:"name,omitempty"`
	Type string `json:"type"`
	// Direction: "up", "down" or "both" (default) for tcp latency,
	// bandwidth and drop.
	Direction string `json:"direction,omitempty"`
	// LatencyMS and JitterMS: latency adds LatencyMS plus a uniform draw
	// in [0, JitterMS) to each chunk.
	LatencyMS float64 `json:"latency_ms,omitempty"`
	JitterMS  float64 `json:"jitter_ms,omitempty"`
	// RateBytes is bandwidth's limit per connection, bytes per second.
	RateBytes int64 `json:"rate_bytes_per_s,omitempty"`
	// Probability is the share of messages a zmq fault acts on, (0, 1];
	// 0 means 1.
	Probability float64 `json:"probability,omitempty"`
	// Count ends a zmq fault after it acted on that many messages (0:
	// never).
	Count uint64 `json:"count,omitempty"`
	// Seed seeds a zmq fault's draws.
	Seed uint64 `json:"seed,omitempty"`
}

// FaultInfo is a fault and, for zmq faults, how many messages it acted on.
type FaultInfo struct {
	FaultSpec
	Fired uint64 `json:"fired"`
	// Done is true once a counted zmq fault has acted Count times.
	Done bool `json:"done"`
}

// ProxyInfo is a proxy's state.
type ProxyInfo struct {
	ProxySpec
	// Addr is the bound address (host:port or ZMQ endpoint).
	Addr   string      `json:"addr"`
	Faults []FaultInfo `json:"faults"`
	// TCP or ZMQ holds the counters of the proxy's kind.
	TCP *faultproxy.Stats      `json:"tcp,omitempty"`
	ZMQ *faultproxy.RelayStats `json:"zmq,omitempty"`
}

// fault is an installed fault; fired is read by Info while the relay's
// goroutine updates it.
type fault struct {
	spec  FaultSpec
	fired atomic.Uint64
	rng   *rand.Rand // only the relay goroutine draws
	act   faultproxy.Action
}

func (f *fault) info() FaultInfo {
	n := f.fired.Load()
	return FaultInfo{FaultSpec: f.spec, Fired: n, Done: f.spec.Count > 0 && n >= f.spec.Count}
}

type entry struct {
	spec   ProxySpec
	tcp    *faultproxy.Proxy
	zmq    *faultproxy.Relay
	faults []*fault
}

// Manager holds the proxies. Its methods are safe for concurrent use.
type Manager struct {
	log     *slog.Logger
	mu      sync.Mutex
	proxies map[string]*entry
	closed  bool
}

// NewManager returns an empty Manager; logger nil discards.
func NewManager(logger *slog.Logger) *Manager {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Manager{log: logger, proxies: map[string]*entry{}}
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// Create starts a proxy. Errors: ErrInvalid, ErrExists, ErrClosed, or the
// listen error.
func (m *Manager) Create(s ProxySpec) (ProxyInfo, error) {
	if !nameRE.MatchString(s.Name) {
		return ProxyInfo{}, fmt.Errorf("%w: proxy name %q (letters, digits, . _ -; up to 64)", ErrInvalid, s.Name)
	}
	if s.Upstream == "" {
		return ProxyInfo{}, fmt.Errorf("%w: proxy %s: empty upstream", ErrInvalid, s.Name)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ProxyInfo{}, ErrClosed
	}
	if _, ok := m.proxies[s.Name]; ok {
		return ProxyInfo{}, fmt.Errorf("%w: proxy %s", ErrExists, s.Name)
	}
	e := &entry{spec: s}
	switch s.Kind {
	case KindTCP:
		cfg := faultproxy.DefaultConfig()
		cfg.Name, cfg.Target, cfg.Logger = s.Name, s.Upstream, m.log
		if s.Listen != "" {
			cfg.Listen = s.Listen
		}
		p, err := faultproxy.New(cfg)
		if err != nil {
			return ProxyInfo{}, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		if err := p.Start(); err != nil {
			return ProxyInfo{}, err
		}
		e.tcp = p
	case KindZMQ:
		cfg := faultproxy.DefaultRelayConfig()
		cfg.Name, cfg.Upstream, cfg.Logger = s.Name, s.Upstream, m.log
		if s.Listen != "" {
			cfg.Listen = s.Listen
		}
		r, err := faultproxy.NewRelay(cfg)
		if err != nil {
			return ProxyInfo{}, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		if err := r.Start(); err != nil {
			_ = r.Close()
			return ProxyInfo{}, err
		}
		e.zmq = r
	default:
		return ProxyInfo{}, fmt.Errorf("%w: proxy %s: kind %q (tcp or zmq)", ErrInvalid, s.Name, s.Kind)
	}
	m.proxies[s.Name] = e
	m.log.Info("proxy created", "proxy", s.Name, "kind", s.Kind, "addr", e.addr(), "upstream", s.Upstream)
	return e.info(), nil
}

func (e *entry) addr() string {
	if e.tcp != nil {
		return e.tcp.Addr()
	}
	return e.zmq.Addr()
}

func (e *entry) info() ProxyInfo {
	pi := ProxyInfo{ProxySpec: e.spec, Addr: e.addr(), Faults: make([]FaultInfo, 0, len(e.faults))}
	for _, f := range e.faults {
		pi.Faults = append(pi.Faults, f.info())
	}
	if e.tcp != nil {
		s := e.tcp.Stats()
		pi.TCP = &s
	} else {
		s := e.zmq.Stats()
		pi.ZMQ = &s
	}
	return pi
}

func (e *entry) close() error {
	if e.tcp != nil {
		return e.tcp.Close()
	}
	return e.zmq.Close()
}

func (m *Manager) get(name string) (*entry, error) {
	e, ok := m.proxies[name]
	if !ok {
		return nil, fmt.Errorf("%w: proxy %s", ErrNotFound, name)
	}
	return e, nil
}

// Get returns one proxy's state.
func (m *Manager) Get(name string) (ProxyInfo, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.get(name)
	if err != nil {
		return ProxyInfo{}, err
	}
	return e.info(), nil
}

// List returns every proxy, by name.
func (m *Manager) List() []ProxyInfo {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]ProxyInfo, 0, len(m.proxies))
	for _, e := range m.proxies {
		out = append(out, e.info())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Delete closes a proxy and forgets it.
func (m *Manager) Delete(name string) error {
	m.mu.Lock()
	e, err := m.get(name)
	if err == nil {
		delete(m.proxies, name)
	}
	m.mu.Unlock()
	if err != nil {
		return err
	}
	m.log.Info("proxy deleted", "proxy", name)
	return e.close()
}

// AddFault validates f and installs it on the proxy. Errors: ErrNotFound,
// ErrInvalid (a type or field that does not fit the proxy's kind),
// ErrConflict (a fault of that name, or of that type on an overlapping
// direction, is already there).
func (m *Manager) AddFault(proxy string, s FaultSpec) (FaultInfo, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.get(proxy)
	if err != nil {
		return FaultInfo{}, err
	}
	f, err := e.check(s)
	if err != nil {
		return FaultInfo{}, err
	}
	e.faults = append(e.faults, f)
	if err := e.apply(); err != nil {
		e.faults = e.faults[:len(e.faults)-1]
		_ = e.apply()
		return FaultInfo{}, err
	}
	m.log.Info("fault added", "proxy", proxy, "fault", f.spec.Name, "type", f.spec.Type)
	return f.info(), nil
}

// RemoveFault removes one fault by name.
func (m *Manager) RemoveFault(proxy, name string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.get(proxy)
	if err != nil {
		return err
	}
	i := slices.IndexFunc(e.faults, func(f *fault) bool { return f.spec.Name == name })
	if i < 0 {
		return fmt.Errorf("%w: fault %s on proxy %s", ErrNotFound, name, proxy)
	}
	e.faults = slices.Delete(e.faults, i, i+1)
	m.log.Info("fault removed", "proxy", proxy, "fault", name)
	return e.apply()
}

// Heal removes every fault of a proxy.
func (m *Manager) Heal(proxy string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, err := m.get(proxy)
	if err != nil {
		return err
	}
	e.faults = nil
	m.log.Info("proxy healed", "proxy", proxy)
	return e.apply()
}

// Cut closes every connection open now on a tcp proxy and returns how many.
func (m *Manager) Cut(proxy string) (int, error) {
	return m.tcpAction(proxy, "cut", (*faultproxy.Proxy).Cut)
}

// HalfOpen makes every connection open now on a tcp proxy half-open
// (faultproxy.Proxy.HalfOpen) and returns how many.
func (m *Manager) HalfOpen(proxy string) (int, error) {
	return m.tcpAction(proxy, "half-open", (*faultproxy.Proxy).HalfOpen)
}

func (m *Manager) tcpAction(proxy, what string, f func(*faultproxy.Proxy) int) (int, error) {
	m.mu.Lock()
	e, err := m.get(proxy)
	m.mu.Unlock()
	if err != nil {
		return 0, err
	}
	if e.tcp == nil {
		return 0, fmt.Errorf("%w: %s is for tcp proxies; %s is zmq", ErrInvalid, what, proxy)
	}
	n := f(e.tcp)
	m.log.Info("proxy "+what, "proxy", proxy, "connections", n)
	return n, nil
}

// Close closes every proxy; the Manager refuses new ones afterwards.
func (m *Manager) Close() error {
	m.mu.Lock()
	m.closed = true
	es := make([]*entry, 0, len(m.proxies))
	for _, e := range m.proxies {
		es = append(es, e)
	}
	m.proxies = map[string]*entry{}
	m.mu.Unlock()
	var errs []error
	for _, e := range es {
		errs = append(errs, e.close())
	}
	return errors.Join(errs...)
}

func directions(d string) ([]faultproxy.Direction, error) {
	switch d {
	case "", "both":
		return faultproxy.Both, nil
	case "up":
		return []faultproxy.Direction{faultproxy.Up}, nil
	case "down":
		return []faultproxy.Direction{faultproxy.Down}, nil
	}
	return nil, fmt.Errorf("%w: direction %q (up, down or both)", ErrInvalid, d)
}

// check validates s for e's kind, fills its defaults and refuses a clash.
func (e *entry) check(s FaultSpec) (*fault, error) {
	bad := func(format string, args ...any) (*fault, error) {
		return nil, fmt.Errorf("%w: fault %s: %s", ErrInvalid, s.Type, fmt.Sprintf(format, args...))
	}
	if s.LatencyMS < 0 || s.JitterMS < 0 || s.RateBytes < 0 || s.Probability < 0 || s.Probability > 1 {
		return bad("negative figure or probability above 1")
	}
	f := &fault{spec: s}
	if e.tcp != nil {
		if s.Probability != 0 || s.Count != 0 || s.Seed != 0 {
			return bad("probability, count and seed are for zmq faults")
		}
		switch s.Type {
		case FaultLatency:
			if s.LatencyMS == 0 && s.JitterMS == 0 {
				return bad("latency_ms or jitter_ms required")
			}
			if s.RateBytes != 0 {
				return bad("rate_bytes_per_s is for bandwidth")
			}
		case FaultBandwidth:
			if s.RateBytes <= 0 {
				return bad("rate_bytes_per_s > 0 required")
			}
			if s.LatencyMS != 0 || s.JitterMS != 0 {
				return bad("latency_ms and jitter_ms are for latency")
			}
		case FaultDrop, FaultRefuse, FaultHold:
			if s.LatencyMS != 0 || s.JitterMS != 0 || s.RateBytes != 0 {
				return bad("takes no figures")
			}
			if s.Type != FaultDrop && s.Direction != "" {
				return bad("is link-wide: no direction")
			}
		default:
			return bad("not a tcp fault (latency, bandwidth, drop, refuse, hold)")
		}
		if _, err := directions(s.Direction); err != nil {
			return nil, err
		}
		if f.spec.Direction == "" && (s.Type == FaultLatency || s.Type == FaultBandwidth || s.Type == FaultDrop) {
			f.spec.Direction = "both"
		}
	} else {
		if s.LatencyMS != 0 || s.JitterMS != 0 || s.RateBytes != 0 || s.Direction != "" {
			return bad("zmq faults take probability, count and seed only")
		}
		switch s.Type {
		case FaultDrop:
			f.act = faultproxy.Drop
		case FaultDuplicate:
			f.act = faultproxy.Duplicate
		case FaultReorder:
			f.act = faultproxy.Swap
		case FaultGarble:
			f.act = faultproxy.Garble
		default:
			return bad("not a zmq fault (drop, duplicate, reorder, garble)")
		}
		if f.spec.Probability == 0 {
			f.spec.Probability = 1
		}
		f.rng = rand.New(rand.NewPCG(s.Seed, 0x6b766d657368))
	}
	if f.spec.Name == "" {
		f.spec.Name = f.spec.Type
		if f.spec.Direction != "" {
			f.spec.Name += "-" + f.spec.Direction
		}
	}
	if !nameRE.MatchString(f.spec.Name) {
		return bad("name %q (letters, digits, . _ -; up to 64)", f.spec.Name)
	}
	for _, o := range e.faults {
		if o.spec.Name == f.spec.Name {
			return nil, fmt.Errorf("%w: fault %s is already on proxy %s", ErrConflict, f.spec.Name, e.spec.Name)
		}
		if e.tcp != nil && o.spec.Type == f.spec.Type && overlap(o.spec.Direction, f.spec.Direction) {
			return nil, fmt.Errorf("%w: proxy %s already has a %s fault on direction %s (%s): remove it first",
				ErrConflict, e.spec.Name, o.spec.Type, o.spec.Direction, o.spec.Name)
		}
	}
	return f, nil
}

func overlap(a, b string) bool {
	return a == b || a == "both" || b == "both" || a == "" || b == ""
}

// apply sets the proxy's switches from the faults installed (tcp) or
// installs a Fault function over them (zmq). Called with m.mu held.
func (e *entry) apply() error {
	if e.zmq != nil {
		fs := slices.Clone(e.faults)
		if len(fs) == 0 {
			e.zmq.SetFault(nil)
			return nil
		}
		e.zmq.SetFault(func(_, _ uint64) faultproxy.Action {
			for _, f := range fs {
				n := f.fired.Load()
				if f.spec.Count > 0 && n >= f.spec.Count {
					continue
				}
				if f.spec.Probability < 1 && f.rng.Float64() >= f.spec.Probability {
					continue
				}
				f.fired.Add(1)
				return f.act
			}
			return faultproxy.Forward
		})
		return nil
	}
	p := e.tcp
	var delay, jitter [2]time.Duration
	var rate [2]int64
	var drop [2]bool
	refuse, hold := false, false
	for _, f := range e.faults {
		dirs, _ := directions(f.spec.Direction)
		for _, d := range dirs {
			switch f.spec.Type {
			case FaultLatency:
				delay[d] = ms(f.spec.LatencyMS)
				jitter[d] = ms(f.spec.JitterMS)
			case FaultBandwidth:
				rate[d] = f.spec.RateBytes
			case FaultDrop:
				drop[d] = true
			}
		}
		refuse = refuse || f.spec.Type == FaultRefuse
		hold = hold || f.spec.Type == FaultHold
	}
	for _, d := range faultproxy.Both {
		p.SetDelay(delay[d], d)
		p.SetJitter(jitter[d], d)
		p.SetBandwidth(rate[d], d)
		p.SetDrop(drop[d], d)
	}
	if hold {
		p.Hold()
	} else {
		p.Release()
	}
	return p.SetRefuse(refuse)
}

func ms(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
