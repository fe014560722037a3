package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/node"
)

// TestExplainShowsCPUTier: an engine with a CPU offload tier (vllmsim
// --kv-offload-blocks) evicts a prompt from its small GPU pool to CPU; the
// gateway's index keeps it as CPU residency (KV events over real ZMQ) and
// kvmesh explain's table shows it in the CPU column with GPU match 0.
func TestExplainShowsCPUTier(t *testing.T) {
	scfg := sim.LocalConfig()
	scfg.ServedModelName = "M"
	scfg.Logger = slog.New(slog.DiscardHandler)
	scfg.NumGPUBlocks = 24
	scfg.KVOffloadBlocks = 256
	scfg.KVEvents.EnableKVCacheEvents = true
	eng, err := sim.NewServer(scfg)
	require.NoError(t, err)
	require.NoError(t, eng.Start(context.Background()))
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = eng.Shutdown(ctx)
	}()
	cfg := node.LocalConfig()
	cfg.IndexMode = "kv-events"
	cfg.Tokenizer = node.TokenizerCharacter // the simulator's byte tokenizer
	cfg.BlockSize = 16
	cfg.Models = []node.ModelConfig{{Name: "M", Replicas: []node.ReplicaConfig{
		{Name: "a", URL: eng.URL(), KVEndpoint: eng.KVEventsAddr(), ReplayEndpoint: eng.KVReplayAddr()}}}}
	n, err := node.New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	defer func() { require.NoError(t, n.Shutdown(context.Background())) }()

	complete := func(prompt string) {
		t.Helper()
		body := fmt.Sprintf(`{"model":"M","prompt":%q,"max_tokens":1}`, prompt)
		resp, err := http.Post(eng.URL()+"/v1/completions", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		_, _ = new(bytes.Buffer).ReadFrom(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	tiers := func(prompt string) (gpu, cpu int) {
		t.Helper()
		var out bytes.Buffer
		require.NoError(t, explain(context.Background(), &out, n.HTTPAddr(), "M", prompt, "cost", "", "", true))
		var rep struct {
			Tiers []node.ReplicaTiers `json:"tiers"`
		}
		require.NoError(t, json.Unmarshal(out.Bytes(), &rep))
		for _, r := range rep.Tiers {
			if r.Name == "a" {
				return r.GPU, r.CPU
			}
		}
		return -1, -1
	}
	doc := func(i int) string {
		return fmt.Sprintf("Document %d\n%s", i, strings.Repeat(fmt.Sprintf("line %d of a long shared prefix. ", i), 6))
	}
	// PUB/SUB drops what is published before the subscription is up:
	// repeat a first prompt until the gateway's index holds it.
	require.Eventually(t, func() bool {
		complete(doc(0))
		g, _ := tiers(doc(0))
		return g > 0
	}, 20*time.Second, 50*time.Millisecond)
	// Later documents push document 0 out of the 24-block GPU pool into
	// the CPU tier.
	for i := 1; i <= 3; i++ {
		complete(doc(i))
	}
	blocks := len(doc(0)) / 16
	require.Eventually(t, func() bool {
		g, c := tiers(doc(0))
		return g == 0 && c == blocks
	}, 10*time.Second, 10*time.Millisecond)

	var out bytes.Buffer
	require.NoError(t, explain(context.Background(), &out, n.HTTPAddr(), "M", doc(0), "cost", "", "", false))
	s := out.String()
	t.Logf("\n%s", s)
	require.Contains(t, s, "REPLICA  MATCHED  CPU  DISK")
	require.Regexp(t, regexp.MustCompile(fmt.Sprintf(`(?m)^a\s+0\s+%d\s+0\s`, blocks)), s)
}
