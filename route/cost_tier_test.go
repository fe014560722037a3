package route

import (
	"errors"
	"math"
	"testing"
)

func TestOffloadPrefillSeconds(t *testing.T) {
	c := DefaultOffloadConfig()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	req := &Request{TotalBlocks: 100, BlockTokens: 16, PromptTokens: 1610} // 10 tokens past the last block
	p := 1.0 / 3000
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-9 }
	// No offload: the recompute term.
	if s, l := c.PrefillSeconds(req, 40, 0, 0, p); !near(s, float64(req.UncachedTokens(40))*p) || l != 0 {
		t.Fatalf("no offload: %v %d", s, l)
	}
	// 30 blocks on CPU after 40 on the GPU: 480 tokens loaded at 50k/s,
	// 490 computed.
	s, l := c.PrefillSeconds(req, 40, 30, 0, p)
	if want := 480.0/50000 + 490*p; !near(s, want) || l != 480 {
		t.Fatalf("cpu: %v %d, want %v 480", s, l, want)
	}
	// Tiers past the prompt's end are clipped: 60 blocks left, 50 CPU + 20 disk -> 50 + 10.
	s, l = c.PrefillSeconds(req, 40, 50, 20, p)
	if want := 800.0/50000 + 160.0/10000 + 10*p; !near(s, want) || l != 960 {
		t.Fatalf("clipped: %v %d, want %v 960", s, l, want)
	}
	// A load slower than recomputing is priced as the recompute.
	slow := OffloadConfig{CPULoadTokensPerSecond: 100, DiskLoadTokensPerSecond: 100}
	if s, _ := slow.PrefillSeconds(req, 0, 100, 0, p); !near(s, 1610*p) {
		t.Fatalf("slow tier: %v, want %v", s, 1610*p)
	}
	if err := (OffloadConfig{CPULoadTokensPerSecond: 1}).Validate(); !errors.Is(err, ErrInvalidConfig) {
		t.Fatal(err)
	}
}
