package sync

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// TestOwnerKeysSaltedAndLoRAAsGateway publishes a LoRA request's salted
// blocks (vLLM's extra_keys) over real ZMQ: every gateway, owner or not,
// must confirm exactly the keys a gateway computes for that request, and
// offload-tier events must not touch them.
func TestOwnerKeysSaltedAndLoRAAsGateway(t *testing.T) {
	pcfg := kvevents.DefaultPublisherConfig()
	pcfg.Endpoint, pcfg.AlwaysBind = "tcp://127.0.0.1:0", true
	pcfg.ReplayEndpoint = "tcp://127.0.0.1:0"
	pub, err := kvevents.NewPublisher(pcfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	src := []KVSource{{Replica: "r0", Model: "m", Endpoint: pub.Addr(), ReplayEndpoint: pub.ReplayAddr()}}
	gws := startCluster(t, 2, nil, func(c *Config) { c.KVSources = src })

	h := gws[0].ix.Hasher()
	bt := h.BlockTokens()
	tokens := make([]uint32, 4*bt)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	// What the gateway computes for the request (model m, LoRA ad1,
	// cache_salt s1), and for the same text without salt.
	want := h.AppendKeys(nil, h.Root("m", "ad1", "s1"), tokens)
	unsalted := h.AppendKeys(nil, h.Root("m", "ad1", ""), tokens)
	require.Len(t, want, 4)

	hashes := []kvevents.EngineHash{11, 12, 13, 14}
	first := &kvevents.BlockStored{BlockHashes: hashes[:2], TokenIDs: tokens[:2*bt], BlockSize: bt,
		Medium: "GPU", LoRAName: "ad1", CacheSalt: "s1"}
	next := &kvevents.BlockStored{BlockHashes: hashes[2:], ParentBlockHash: hashes[1], HasParent: true,
		TokenIDs: tokens[2*bt:], BlockSize: bt, Medium: "GPU", LoRAName: "ad1", HasExtraKeys: true}
	// A CPU offload copy of another sequence: not the GPU cache.
	cpu := &kvevents.BlockStored{BlockHashes: []kvevents.EngineHash{21}, TokenIDs: tokens[:bt], BlockSize: bt, Medium: "CPU"}
	_, err = pub.Publish(kvevents.Batch{TS: 1, Events: []kvevents.Event{
		{Kind: kvevents.KindBlockStored, Stored: first},
		{Kind: kvevents.KindBlockStored, Stored: next},
		{Kind: kvevents.KindBlockStored, Stored: cpu},
	}})
	require.NoError(t, err)

	require.Eventually(t, func() bool {
		for _, g := range gws {
			if matchOn(g, want, 0, index.ModeKVEvents) != len(want) {
				return false
			}
		}
		return true
	}, converge, 10*time.Millisecond, "salted LoRA keys not confirmed on every gateway")
	for _, g := range gws {
		require.Zero(t, matchOn(g, unsalted, 0, index.ModeKVEvents), "%s: keyed without the salt", g.name)
		require.Equal(t, len(want), confirmed(g), "%s: the CPU-tier store was indexed", g.name)
	}

	// The CPU tier dropping its copy of the blocks leaves the GPU copy;
	// the GPU eviction of the last two removes exactly those everywhere.
	_, err = pub.Publish(kvevents.Batch{TS: 2, Events: []kvevents.Event{
		{Kind: kvevents.KindBlockRemoved, Removed: &kvevents.BlockRemoved{BlockHashes: hashes, Medium: "CPU"}},
		{Kind: kvevents.KindBlockRemoved, Removed: &kvevents.BlockRemoved{BlockHashes: hashes[2:], Medium: "GPU"}},
	}})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		for _, g := range gws {
			if matchOn(g, want, 0, index.ModeKVEvents) != 2 || confirmed(g) != 2 {
				return false
			}
		}
		return true
	}, converge, 10*time.Millisecond, "GPU removal not applied, or CPU removal applied")
}
