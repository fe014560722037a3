package des

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// TestSharedScrapes: an isolated gateway whose scrape shows requests it
// did not send (another gateway's) scrapes every engine every
// SharedScrapeInterval from then on, as node does (scrapeAfter), so it
// sees the next request the other gateway sends within one such
// interval instead of the rest of a ScrapeInterval. Synced gateways,
// whose peers report their load, and isolated ones with the shared
// interval off scrape every ScrapeInterval.
func TestSharedScrapes(t *testing.T) {
	for _, tc := range []struct {
		name   string
		noSync bool
		shared time.Duration
		sees   bool // gateway 0 sees the second request by 1.15 s
	}{
		{"isolated", true, 100 * time.Millisecond, true},
		{"isolated, shared interval off", true, 0, false},
		{"synced", false, 100 * time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := DefaultOptions()
			o.Replicas, o.Gateways = 1, 2
			o.NoSync, o.SharedScrapeInterval = tc.noSync, tc.shared
			o.LoadDelay = time.Hour // synced peers' reports come too late to matter here
			w, err := New(o)
			require.NoError(t, err)
			send := func() {
				w.Send(study.Request{Prompt: strings.Repeat("a long answer please ", 20), MaxTokens: 4000,
					Target: study.Target{Gateway: 1, Strategy: "least-request"}}, func(study.Outcome) {})
			}
			g := w.gws[0]
			seen := func() int { return g.running[0] + g.waiting[0] }
			var before, after int
			var others bool
			w.At(0, send)                     // scraped by gateway 0 at 0.1 s or 0.5 s
			w.At(1020*time.Millisecond, send) // after gateway 0's scrape at 1.0 s
			w.At(1010*time.Millisecond, func() { before = seen() })
			w.At(1150*time.Millisecond, func() { after, others = seen(), g.othersSeen })
			w.At(2*time.Second, func() { w.Close() })
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			_ = w.Run(ctx)
			require.Equal(t, 1, before, "gateway 0 sees the first request by 1 s")
			require.Equal(t, tc.noSync && tc.shared > 0, others)
			if tc.sees {
				require.Equal(t, 2, after, "scraped within a shared interval of the second request")
			} else {
				require.Equal(t, 1, after, "not scraped again before 1.5 s")
			}
		})
	}
}

// TestScrapeShowsTheLastStepThatEnded: an engine's gauges show a step's
// requests once the step has ended, as vLLM's and sim.Server's do, not
// while it runs: a request in its first prefill step is not yet running
// to a scrape (the gateway's or the study's).
func TestScrapeShowsTheLastStepThatEnded(t *testing.T) {
	o := DefaultOptions()
	o.Replicas, o.Gateways = 1, 1
	w, err := New(o)
	require.NoError(t, err)
	r := w.reps[0]
	var step time.Duration
	type seen struct{ shown, engine, gateway, study int }
	var during, after seen
	look := func(s *seen) func() {
		return func() {
			w.gws[0].scrape()
			w.Observe(func(ob study.Observation) { s.study = ob.Running[0] })
			s.shown, s.engine, s.gateway = w.EngineStats()[0].Running, r.eng.Gauges().Running, w.gws[0].running[0]
		}
	}
	w.At(0, func() {
		w.Send(study.Request{Prompt: strings.Repeat("a long prompt to prefill ", 400), MaxTokens: 8,
			Target: study.Target{Gateway: 0, Strategy: "least-request"}}, func(study.Outcome) {})
	})
	w.At(time.Millisecond, func() {
		step = r.cur.Duration
		require.Greater(t, step, 10*time.Millisecond, "the first prefill step")
		w.At(step/2, look(&during))
		w.At(step+time.Millisecond, look(&after))
		w.At(step+2*time.Millisecond, func() { w.Close() })
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_ = w.Run(ctx)
	require.Equal(t, seen{shown: 0, engine: 1, gateway: 0, study: 0}, during, "during the first step")
	require.Equal(t, seen{shown: 1, engine: 1, gateway: 1, study: 1}, after, "after it")
}

// TestNewsKeepsSendsTheStepMayNotShow mirrors node's
// TestScrapeNewsResetsUnshownSends: a scrape that brings news keeps
// counting as unshown the requests in flight that were sent after the
// step that ended with the last token began (route.SendLog.Unshown), and
// none before any token.
func TestNewsKeepsSendsTheStepMayNotShow(t *testing.T) {
	o := DefaultOptions()
	o.Replicas, o.Gateways, o.NoSync = 1, 1, true
	w, err := New(o)
	require.NoError(t, err)
	g := w.gws[0]
	ms := int64(time.Millisecond)
	scrape := func() int { // a due scrape of a changed engine
		if g.scrapeDue != nil {
			g.scrapeDue[0] = 0
		}
		g.scraped[0]--
		g.scrape()
		return g.unshownSent[0]
	}
	var got [4]int
	w.At(time.Second, func() {
		now := w.nowNs()
		g.inflight[0] = 3 // three requests in flight, sent 300, 50 and 10 ms ago
		for _, ago := range []int64{300, 50, 10} {
			g.sent(0, now-ago*ms, 0)
		}
		got[0] = scrape() // the same figures, no token: no news
		g.scrapedInflight[0] = -1
		got[1] = scrape() // news (as a first scrape), no token yet: none kept
		// A step of 100 ms ended, its token 1 ms after the last scrape
		// (the scrapes here all come at one virtual instant).
		g.sawToken(0, now+ms, 100*ms, false)
		got[2] = scrape()
		g.inflight[0] = 1 // the oldest and the newest ended
		g.sends[0].Remove(now-300*ms, 0, true)
		g.sends[0].Remove(now-10*ms, 0, true)
		g.sawToken(0, now+2*ms, 100*ms, false)
		got[3] = scrape()
		g.inflight[0] = 0
		g.sends[0].Remove(now-50*ms, 0, true)
		w.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_ = w.Run(ctx)
	require.Equal(t, [4]int{3, 0, 2, 1}, got,
		"no news; news before any token; sent during the step that ended with the last token; only those still in flight")
}
