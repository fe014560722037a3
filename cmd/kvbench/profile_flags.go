package main

import (
	"fmt"
	"strings"

	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/chaos/des"
)

// Engine-profile flags: the study axis of issue 16. They shape the DES
// engines (a hybrid-attention model's KV-cache groups, a CPU offload
// tier), so the same seed grid can be run plain, hybrid and offloaded and
// the reports compared; the report's header names the profile.
var profileFlags = []string{"engine-kv-tokens", "engine-max-num-seqs", "hybrid-sliding-window", "hybrid-window-tokens", "kv-offload-blocks", "kv-offload-tokens-per-second"}

func init() { desFlags = append(desFlags, profileFlags...) }

// addEngineProfileFlags registers the engine-profile flags on f.
func addEngineProfileFlags(f *pflag.FlagSet, opt *options) {
	f.IntVar(&opt.des.EngineTokens, "engine-kv-tokens", opt.des.EngineTokens,
		"DES: each engine's GPU KV pool in tokens (of a hybrid model: its full-attention group's)")
	f.IntVar(&opt.des.MaxNumSeqs, "engine-max-num-seqs", opt.des.MaxNumSeqs,
		"DES: each engine's running-set size (vLLM --max-num-seqs; default: the seed study's 8)")
	f.IntVar(&opt.des.HybridSlidingWindow, "hybrid-sliding-window", 0,
		"DES: engines are a hybrid-attention model: a full-attention KV-cache group and a sliding-window group of this many tokens, evicting independently (group_idx events; vLLM's hybrid hit rule); 0: one group")
	f.IntVar(&opt.des.HybridWindowTokens, "hybrid-window-tokens", 0,
		"DES: the sliding-window group's KV pool in tokens (0: as large as the full-attention group's)")
	f.IntVar(&opt.des.OffloadBlocks, "kv-offload-blocks", 0,
		"DES: each engine's CPU offload tier in engine blocks (0: none): GPU evictions go there, publish CPU events and load instead of being recomputed")
	f.Float64Var(&opt.des.OffloadLoadTokensPerSecond, "kv-offload-tokens-per-second", 0,
		"DES: the offload tier's load rate in prompt tokens per second (0: the cost model's default CPU rate)")
}

// engineProfileText describes o's engine profile for the report header
// ("" for plain single-group engines without a tier).
func engineProfileText(o des.Options) string {
	var parts []string
	if o.HybridSlidingWindow > 0 {
		pool := "as large as the full-attention group's"
		if o.HybridWindowTokens > 0 {
			pool = fmt.Sprintf("%d tokens", o.HybridWindowTokens)
		}
		parts = append(parts, fmt.Sprintf("hybrid attention (full + %d-token sliding window, window pool %s)", o.HybridSlidingWindow, pool))
	}
	d := des.DefaultOptions()
	if o.EngineTokens != d.EngineTokens {
		parts = append(parts, fmt.Sprintf("GPU KV pool of %d tokens", o.EngineTokens))
	}
	if o.MaxNumSeqs != d.MaxNumSeqs {
		parts = append(parts, fmt.Sprintf("running sets of %d sequences", o.MaxNumSeqs))
	}
	if o.OffloadBlocks > 0 {
		parts = append(parts, fmt.Sprintf("CPU offload tier of %d blocks", o.OffloadBlocks))
	}
	if bt := des.IndexBlockTokens(o.EngineBlockSize); bt != o.EngineBlockSize {
		parts = append(parts, fmt.Sprintf("indexed at %d-token blocks", bt))
	}
	return strings.Join(parts, ", ")
}
