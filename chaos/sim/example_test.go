package sim_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/chaos/sim"
)

// Example starts an in-process replica with KV events on, sends one request
// and reads the engine's cached blocks.
func Example() {
	cfg := sim.LocalConfig() // 127.0.0.1:0, fast profile, bytes tokenizer
	cfg.ServedModelName = "demo"
	cfg.KVEvents.EnableKVCacheEvents = true // PUB and replay ROUTER on 127.0.0.1:0
	s, err := sim.NewServer(cfg)
	if err != nil {
		panic(err)
	}
	if err := s.Start(context.Background()); err != nil {
		panic(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
	}()
	// Subscribers connect to s.KVEventsAddr() and s.KVReplayAddr().
	resp, err := http.Post(s.URL()+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"demo","prompt":"`+strings.Repeat("x", 40)+`","max_tokens":1}`))
	if err != nil {
		panic(err)
	}
	resp.Body.Close()
	blocks := s.CachedBlocks()
	fmt.Println(resp.StatusCode, len(blocks), len(blocks[0].Tokens), blocks[0].HasParent)
	// Output: 200 2 16 false
}
