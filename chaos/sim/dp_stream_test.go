package sim

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestDPFrontStreamsConcurrently: streams through a DPServer's front, four
// at a time, all end with [DONE] (the front must not cut a rank's stream).
func TestDPFrontStreamsConcurrently(t *testing.T) {
	cfg := LocalConfig()
	cfg.ServedModelName = "m"
	cfg.Logger = slog.New(slog.DiscardHandler)
	cfg.DataParallelSize = 2
	cfg.KVEvents.Endpoint, cfg.KVEvents.ReplayEndpoint = "", ""
	d, err := NewDPServer(cfg)
	require.NoError(t, err)
	require.NoError(t, d.Start(context.Background()))
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, d.Shutdown(ctx))
	}()
	tr := &http.Transport{MaxIdleConnsPerHost: 16}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 20 * time.Second}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	var mu sync.Mutex
	var bad []string
	for i := range 300 {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			body := fmt.Sprintf(`{"model":"m","prompt":"prompt %d %s","max_tokens":3,"stream":true}`, i, strings.Repeat("x", i%200))
			resp, err := hc.Post(d.URL()+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				mu.Lock()
				bad = append(bad, err.Error())
				mu.Unlock()
				return
			}
			raw, err := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			last := ""
			sc := bufio.NewScanner(strings.NewReader(string(raw)))
			for sc.Scan() {
				if l := sc.Text(); l != "" {
					last = l
				}
			}
			if err != nil || last != "data: [DONE]" {
				mu.Lock()
				bad = append(bad, fmt.Sprintf("%v %q", err, last))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.Empty(t, bad)
}
