package sim

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// batchTiming is one batch-of-n measurement through the real-time driver.
type batchTiming struct {
	// modelTPOT is the engine's mean TPOT in model time, (E2E-TTFT)/(n-1).
	modelTPOT time.Duration
	// clientTPOT is what a client sees: wall time between its first and
	// last token / (n-1), times Speed.
	clientTPOT time.Duration
	// modelTTFT is the engine's mean TTFT (model time).
	modelTTFT time.Duration
	st        Stats
}

// measureBatch submits n identical-length prompts at once to a real-time
// l20 server at speed and measures the mean TPOT as the engine and as a
// client see it. With load > 0, that many goroutines spin on the CPU for the
// whole measurement (bounded by its duration and a 30 s cap).
func measureBatch(t *testing.T, speed float64, n, maxTokens, load int) batchTiming {
	t.Helper()
	cfg := LocalConfig()
	cfg.Profile = ProfileL20Qwen27BFP8
	cfg.Speed = speed
	cfg.MaxNumSeqs = 8
	cfg.MaxNumBatchedTokens = 2048
	cfg.Publisher = &recordingPublisher{}
	cfg.Logger = slog.New(slog.DiscardHandler)
	s, err := NewServer(cfg)
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background()))
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, s.Shutdown(ctx))
	}()

	var stop atomic.Bool
	var spin sync.WaitGroup
	deadline := time.Now().Add(30 * time.Second)
	for range load {
		spin.Go(func() {
			x := 0
			for !stop.Load() && time.Now().Before(deadline) {
				for range 10_000 {
					x++
				}
			}
			runtime.KeepAlive(x)
		})
	}
	defer func() { stop.Store(true); spin.Wait() }()

	type res struct{ model, client, ttft time.Duration }
	out := make(chan res, n)
	var wg sync.WaitGroup
	for i := range n {
		prompt := make([]uint32, 200)
		for j := range prompt {
			prompt[j] = uint32(1000*i + j)
		}
		_, ch, err := s.submit("cmpl", prompt, maxTokens)
		require.NoError(t, err)
		wg.Go(func() {
			var first, last time.Time
			var ttft time.Duration
			for ev := range ch {
				now := time.Now()
				if ev.fin != nil {
					out <- res{
						model:  (ev.fin.E2E - ttft) / time.Duration(maxTokens-1),
						client: time.Duration(float64(last.Sub(first)) * speed / float64(maxTokens-1)),
						ttft:   ttft,
					}
					return
				}
				if ev.out.Index == 0 {
					first, ttft = now, ev.out.TTFT
				}
				last = now
			}
		})
	}
	wg.Wait()
	close(out)
	var bt batchTiming
	for r := range out {
		bt.modelTPOT += r.model / time.Duration(n)
		bt.clientTPOT += r.client / time.Duration(n)
		bt.modelTTFT += r.ttft / time.Duration(n)
	}
	bt.st = s.Stats()
	return bt
}

// TestDriverUnderCPULoad compares a batch of 8 on the l20 profile at speed
// 10 on a quiet process and with CPU-spinning goroutines (2 per core), as
// the study harness runs it, and logs model TPOT, client-observed TPOT and
// the driver lag. It checks that host load does not stretch model time; the
// client figures and the lag depend on the host. It takes a few seconds of
// busy CPU: run it with
// KVMESH_SIM_LOAD_TEST=1 go test -run DriverUnderCPULoad -v ./chaos/sim
func TestDriverUnderCPULoad(t *testing.T) {
	if os.Getenv("KVMESH_SIM_LOAD_TEST") == "" {
		t.Skip("set KVMESH_SIM_LOAD_TEST=1 to run")
	}
	modelled := ProfileL20Qwen27BFP8.StepTime(0, 8)
	for _, load := range []int{0, 2 * runtime.GOMAXPROCS(0)} {
		bt := measureBatch(t, 10, 8, 64, load)
		t.Logf("speed 10, batch 8, %d spinning goroutines: model TPOT %v (modelled %v), client TPOT %v, model TTFT %v; %s",
			load, bt.modelTPOT, modelled, bt.clientTPOT, bt.modelTTFT, lagSummary(bt.st))
		// Host delay must not become model time: the engine's TPOT is the
		// modelled decode step, plus at most a little prefill interference
		// from requests admitted a step apart.
		require.Less(t, bt.modelTPOT, modelled*11/10, "model TPOT stretched by host load")
	}
}

func lagSummary(st Stats) string {
	if st.DriverSteps == 0 {
		return "no steps"
	}
	return fmt.Sprintf("driver lag over %d steps: mean %v, max %v (wall)", st.DriverSteps, st.DriverLagSum/time.Duration(st.DriverSteps), st.DriverLagMax)
}
