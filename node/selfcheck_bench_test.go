package node

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/route"
)

// BenchmarkSelfCheck measures what the self-check adds to one response of
// the seed prompt (28.6 KB, 1,790 blocks of 16 in character mode) on a
// KV-event replica whose confirmed entries hold the whole prompt (the
// longest walk): the confirmed run at routing time and the comparison with
// the response's usage (window update, metrics).
func BenchmarkSelfCheck(b *testing.B) {
	cfg := testConfig()
	cfg.Tokenizer = TokenizerCharacter
	cfg.BlockSize = 16
	cfg.IndexMode = "kv-events"
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{{Name: "a", URL: "http://127.0.0.1:1", KVBind: "tcp://127.0.0.1:0"}}}}
	n, err := New(cfg, nil)
	require.NoError(b, err)
	prompt := seedPrompt(1, 1)
	toks := make([]uint32, len(prompt))
	for i := range prompt {
		toks[i] = uint32(prompt[i])
	}
	p := n.tbl.Load().pools[0]
	rep := p.replicas[0]
	root := n.hasher.Root("m", "", "")
	keys := n.hasher.AppendKeys(nil, root, toks)
	hashes := make([]uint64, len(keys))
	for i := range hashes {
		hashes[i] = uint64(i + 1)
	}
	n.index.SetReplicaRoot(rep.id, root)
	require.NoError(b, n.index.ApplyStored(rep.id, index.StoredBlocks{Hashes: hashes, Tokens: toks[:len(keys)*16], BlockTokens: 16}))
	dec := decision{pool: p, rep: rep, Routed: route.Routed{Matched: len(keys)},
		req: route.Request{TotalBlocks: len(keys), BlockTokens: 16, PromptTokens: len(toks)}}
	u := usageFigures{prompt: len(toks), cached: (len(keys) - 1) * 16, promptOK: true, cachedOK: true}
	require.Equal(b, len(keys), n.confirmedPrediction(dec, keys))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		c := n.confirmedPrediction(dec, keys)
		n.checkPrediction(dec, c, u)
	}
}
