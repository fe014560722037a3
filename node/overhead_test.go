package node

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// ttftOnce sends one streaming request and returns the time to the first
// body byte; it then drains the stream and checks it is complete.
func ttftOnce(client *http.Client, url string, body []byte, want int) (time.Duration, error) {
	start := time.Now()
	resp, err := client.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("status %d", resp.StatusCode)
	}
	var one [1]byte
	if _, err := io.ReadFull(resp.Body, one[:]); err != nil {
		return 0, err
	}
	ttft := time.Since(start)
	n, err := io.Copy(io.Discard, resp.Body)
	if err != nil {
		return 0, err
	}
	if int(n)+1 != want {
		return 0, fmt.Errorf("stream of %d bytes, want %d", n+1, want)
	}
	return ttft, nil
}

// phase runs conc workers, each sending perWorker streaming requests to
// url one after another; worker i starts after i·stagger, so that about
// conc streams are open at any time and arrivals are spread out rather than
// all at once. It appends every request's TTFT to out.
func phase(client *http.Client, url string, body []byte, want, conc, perWorker int, stagger time.Duration, out []time.Duration) ([]time.Duration, error) {
	res := make([][]time.Duration, conc)
	errs := make([]error, conc)
	var wg sync.WaitGroup
	for i := 0; i < conc; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i) * stagger) // pacing the load, not waiting for a condition
			for k := 0; k < perWorker; k++ {
				d, err := ttftOnce(client, url, body, want)
				if err != nil {
					errs[i] = err
					return
				}
				res[i] = append(res[i], d)
			}
		}()
	}
	wg.Wait()
	for i := range res {
		if errs[i] != nil {
			return out, errs[i]
		}
		out = append(out, res[i]...)
	}
	return out, nil
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	// Linear interpolation between closest ranks, as the study does.
	pos := p * float64(len(sorted)-1)
	lo := int(pos)
	if lo+1 >= len(sorted) {
		return sorted[len(sorted)-1]
	}
	frac := pos - float64(lo)
	return sorted[lo] + time.Duration(math.Round(frac*float64(sorted[lo+1]-sorted[lo])))
}

// BenchmarkProxyOverhead measures the TTFT the gateway adds at 200
// concurrent streams. The engine is a fast fake: the first SSE event
// leaves at once, then one event every 20 ms (25 events, a 0.5 s stream).
// Each iteration runs two phases, direct to the engine and through a
// gateway in front of it (alternating which goes first): 200 workers with
// staggered starts each send 5 streaming requests of the seed's 28.6 KB
// prompt back to back, so about 200 streams stay open and about 400
// requests arrive per second. It reports p50/p99 TTFT of both paths and
// their difference. A second case runs 20 streams, to separate the
// gateway's own latency from CPU contention on a small machine. Run
// bounded: -bench ProxyOverhead -benchtime 2x.
func BenchmarkProxyOverhead(b *testing.B) {
	for _, conc := range []int{20, 200} {
		b.Run(fmt.Sprintf("streams=%d", conc), func(b *testing.B) { benchProxyOverhead(b, conc) })
	}
}

func benchProxyOverhead(b *testing.B, conc int) {
	const (
		perWorker = 5
		events    = 24
		gap       = 20 * time.Millisecond
	)
	e := newFakeEngine(b, "a")
	e.chunks.Store(events)
	e.chunkDelay.Store(int64(gap))
	n := startNode(b, func(c *Config) {
		c.Strategy = "least-request"
		c.Tokenizer = TokenizerCharacter
		c.HealthTimeout = 2 * time.Second // the machine is saturated on purpose
		c.ScrapeTimeout = 2 * time.Second
	}, rc("a", e.url()))
	body, err := json.Marshal(map[string]any{"model": "m", "prompt": seedPrompt(1, 1), "stream": true, "max_tokens": events})
	require.NoError(b, err)
	want := len(streamBody("a", events))
	newClient := func() *http.Client {
		return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * conc, DisableCompression: true}}
	}
	directC, gwC := newClient(), newClient()
	defer directC.CloseIdleConnections()
	defer gwC.CloseIdleConnections()
	directURL := e.url() + "/v1/completions"
	gwURL := "http://" + n.HTTPAddr() + "/v1/completions"
	stagger := (events + 1) * gap / time.Duration(conc)

	// Warm both connection pools.
	_, err = phase(directC, directURL, body, want, conc, 1, 0, nil)
	require.NoError(b, err)
	_, err = phase(gwC, gwURL, body, want, conc, 1, 0, nil)
	require.NoError(b, err)

	var direct, gw []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%2 == 0 {
			direct, err = phase(directC, directURL, body, want, conc, perWorker, stagger, direct)
			require.NoError(b, err)
			gw, err = phase(gwC, gwURL, body, want, conc, perWorker, stagger, gw)
		} else {
			gw, err = phase(gwC, gwURL, body, want, conc, perWorker, stagger, gw)
			require.NoError(b, err)
			direct, err = phase(directC, directURL, body, want, conc, perWorker, stagger, direct)
		}
		require.NoError(b, err)
	}
	b.StopTimer()
	slices.Sort(direct)
	slices.Sort(gw)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	d50, d99 := percentile(direct, 0.50), percentile(direct, 0.99)
	g50, g99 := percentile(gw, 0.50), percentile(gw, 0.99)
	b.ReportMetric(ms(d50), "direct-p50-ms")
	b.ReportMetric(ms(d99), "direct-p99-ms")
	b.ReportMetric(ms(g50), "gateway-p50-ms")
	b.ReportMetric(ms(g99), "gateway-p99-ms")
	b.ReportMetric(ms(g50-d50), "added-p50-ms")
	b.ReportMetric(ms(g99-d99), "added-p99-ms")
	b.ReportMetric(float64(len(gw)), "streams/path")
}

func TestPercentile(t *testing.T) {
	d := []time.Duration{10, 20, 30, 40, 50}
	require.Equal(t, time.Duration(30), percentile(d, 0.5))
	require.Equal(t, time.Duration(48), percentile(d, 0.95))
	require.Equal(t, time.Duration(50), percentile(d, 1))
	require.Equal(t, time.Duration(0), percentile(nil, 0.5))
}
