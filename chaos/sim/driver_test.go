package sim

import (
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
)

// newDriverOnly builds an l20 server at speed 10 with only its driver
// running (no listener: synctest's clock needs every goroutine blocked on
// channels or timers). afterWake runs after each wake-up of the driver.
// Call it inside a synctest bubble.
func newDriverOnly(t *testing.T, afterWake func()) *Server {
	t.Helper()
	cfg := LocalConfig()
	cfg.Profile = ProfileL20Qwen27BFP8
	cfg.Speed = 10
	cfg.MaxNumSeqs = 8
	cfg.MaxNumBatchedTokens = 2048
	cfg.Publisher = &recordingPublisher{}
	cfg.Logger = slog.New(slog.DiscardHandler)
	s, err := NewServer(cfg)
	require.NoError(t, err)
	s.afterWake = afterWake
	s.startDriver()
	t.Cleanup(func() {
		s.stopDriver()
		s.driverWG.Wait()
	})
	synctest.Wait() // the driver is idle, waiting for work
	return s
}

// tokenTimes is what one request's handler saw.
type tokenTimes struct {
	ttft, e2e time.Duration // model time, from the engine
	wall      []time.Time   // when each output token was released
}

func collect(ch <-chan reqEvent) tokenTimes {
	var tt tokenTimes
	for ev := range ch {
		if ev.fin != nil {
			tt.e2e = ev.fin.E2E
			return tt
		}
		if ev.out.Index == 0 {
			tt.ttft = ev.out.TTFT
		}
		tt.wall = append(tt.wall, time.Now())
	}
	return tt
}

func testPrompt(i, n int) []uint32 {
	p := make([]uint32, n)
	for j := range p {
		p[j] = uint32(1000*i + j)
	}
	return p
}

// TestLateDriverWakeDoesNotStretchModelTime runs a batch of 8 through the
// real-time driver on a fake clock, once with a punctual driver and once
// with one that wakes 25 ms (wall; 250 ms of model time at speed 10) late
// every time it sleeps. The engine's TTFT and TPOT are the modelled ones in
// both runs; only the lag statistics and the release times differ.
func TestLateDriverWakeDoesNotStretchModelTime(t *testing.T) {
	const n, maxTokens = 8, 32
	prof := ProfileL20Qwen27BFP8
	wantTTFT := prof.StepTime(n*200, 0) // one step prefills all 8 prompts
	wantTPOT := prof.StepTime(0, n)
	for _, delay := range []time.Duration{0, 25 * time.Millisecond} {
		t.Run(fmt.Sprint("delay=", delay), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				gate := make(chan struct{})
				var once sync.Once
				s := newDriverOnly(t, func() {
					once.Do(func() { <-gate }) // hold the first step until all 8 are in
					time.Sleep(delay)
				})
				start := time.Now()
				var wg sync.WaitGroup
				got := make([]tokenTimes, n)
				for i := range n {
					_, ch, err := s.submit("cmpl", testPrompt(i, 200), maxTokens)
					require.NoError(t, err)
					wg.Go(func() { got[i] = collect(ch) })
				}
				close(gate)
				wg.Wait()
				for _, g := range got {
					require.Len(t, g.wall, maxTokens)
					require.Equal(t, wantTTFT, g.ttft, "model TTFT")
					require.Equal(t, wantTPOT, (g.e2e-g.ttft)/(maxTokens-1), "model TPOT")
					if delay == 0 {
						// A punctual driver releases every token when its
						// model time is due on the wall clock.
						for k, w := range g.wall {
							due := start.Add((wantTTFT + time.Duration(k)*wantTPOT) / 10)
							require.Equal(t, due, w, "token %d release time", k)
						}
					} else {
						// A late one releases late but never early, and
						// catches up: the last token is at most one delay
						// behind its schedule.
						last := start.Add((wantTTFT + (maxTokens-1)*wantTPOT) / 10)
						require.False(t, g.wall[maxTokens-1].Before(last))
						require.LessOrEqual(t, g.wall[maxTokens-1].Sub(last), delay)
					}
				}
				st := s.Stats()
				require.Equal(t, uint64(maxTokens), st.DriverSteps)
				if delay == 0 {
					require.Zero(t, st.DriverLagMax)
				} else {
					require.GreaterOrEqual(t, st.DriverLagMax, delay)
					require.Positive(t, st.DriverLagSum)
				}
				body := scrapeRegistry(t, s)
				require.Contains(t, body, fmt.Sprintf("kvmesh_sim_driver_lag_seconds_count{model_name=%q} %d", "sim-model", maxTokens))
				require.Contains(t, body, fmt.Sprintf("vllm:time_per_output_token_seconds_count{model_name=%q} %d", "sim-model", n*(maxTokens-1)))
			})
		})
	}
}

// TestArrivalDuringLagJoinsNoEarlierStep checks that a request submitted
// while the driver is behind schedule is not computed in a step that starts,
// in model time, before it arrived: its TTFT is at least its own prefill.
func TestArrivalDuringLagJoinsNoEarlierStep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := newDriverOnly(t, func() { time.Sleep(100 * time.Millisecond) })
		_, ch1, err := s.submit("cmpl", testPrompt(1, 200), 64)
		require.NoError(t, err)
		var wg sync.WaitGroup
		var r1, r2 tokenTimes
		wg.Go(func() { r1 = collect(ch1) })
		time.Sleep(50 * time.Millisecond) // the driver is asleep in its late wake-up
		_, ch2, err := s.submit("cmpl", testPrompt(2, 200), 8)
		require.NoError(t, err)
		st := s.Stats()
		require.Equal(t, 2, st.Queued, "both requests wait for the late driver")
		require.Zero(t, st.Waiting, "no step has seen them: vLLM's gauge does not show them yet")
		wg.Go(func() { r2 = collect(ch2) })
		wg.Wait()
		prof := ProfileL20Qwen27BFP8
		require.Equal(t, prof.StepTime(200, 0), r1.ttft)
		// r2 arrived at model 0.5 s, while r1 decodes; it joins the first
		// step starting at or after that, next to r1's decode.
		own := prof.StepTime(200, 1)
		require.GreaterOrEqual(t, r2.ttft, own)
		require.Less(t, r2.ttft, own+prof.StepTime(0, 1))
	})
}

func scrapeRegistry(t *testing.T, s *Server) string {
	t.Helper()
	mfs, err := s.metrics.reg.Gather()
	require.NoError(t, err)
	var sb []byte
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if h := m.GetHistogram(); h != nil {
				sb = fmt.Appendf(sb, "%s_count{model_name=%q} %d\n", mf.GetName(), "sim-model", h.GetSampleCount())
			}
		}
	}
	return string(sb)
}

// TestGaugesShowWhenTheStepEnds checks that a scrape during a step reads
// the gauges of the step before, as vLLM's do (it takes them from the
// scheduler when a step ends): a request in its first prefill step shows
// as queued, not running, until that step's time has passed.
func TestGaugesShowWhenTheStepEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := newDriverOnly(t, nil)
		prof := ProfileL20Qwen27BFP8
		// 4,000 tokens take two prefill steps of the 2,048-token budget.
		_, ch, err := s.submit("cmpl", testPrompt(1, 4000), 4)
		require.NoError(t, err)
		done := make(chan tokenTimes, 2)
		go func() { done <- collect(ch) }()
		synctest.Wait() // the driver computed the first step and sleeps through it
		wall := func(d time.Duration) time.Duration { return d / 10 }
		first := wall(prof.StepTime(2048, 0))

		st := s.Stats()
		require.Equal(t, [3]int{0, 0, 1}, [3]int{st.Running, st.Waiting, st.Queued},
			"running, waiting, queued during the first step: no step has ended")
		require.Zero(t, st.KVUsage)

		time.Sleep(first - time.Millisecond)
		synctest.Wait()
		st = s.Stats()
		require.Zero(t, st.Running, "a millisecond before the first step ends")
		require.Equal(t, 1, st.Queued)

		time.Sleep(2 * time.Millisecond)
		synctest.Wait()
		st = s.Stats()
		require.Equal(t, [3]int{1, 0, 0}, [3]int{st.Running, st.Waiting, st.Queued},
			"after the first step: running its second prefill chunk")
		require.Positive(t, st.KVUsage)

		// A request arriving now waits in the inbox for the next step.
		_, ch2, err := s.submit("cmpl", testPrompt(2, 100), 2)
		require.NoError(t, err)
		go func() { done <- collect(ch2) }()
		st = s.Stats()
		require.Equal(t, [3]int{1, 0, 1}, [3]int{st.Running, st.Waiting, st.Queued})

		<-done
		<-done
		synctest.Wait()
		st = s.Stats()
		require.Equal(t, [3]int{0, 0, 0}, [3]int{st.Running, st.Waiting, st.Queued}, "idle again")
		require.Zero(t, st.KVUsage)
	})
}
