package sim

import (
	"fmt"
	"sort"
	"time"
)

// Profile is a step-time model: how long one engine step takes given what it
// computes. A step's duration is
//
//	StepOverhead + max(WeightRead, prefillTokens*PrefillPerToken) + decodeSeqs*DecodePerSeq
//
// and zero for an empty step. Every forward pass streams all weights from
// memory once (WeightRead); prefill is compute bound and hides that read
// once it is long enough; every decoding sequence adds its KV reads and
// sampling (DecodePerSeq). Prefix-cached tokens are not computed and cost
// nothing.
type Profile struct {
	// Name is what --profile accepts.
	Name string
	// StepOverhead is the fixed per-step cost: scheduling, input
	// preparation, kernel launches, sampling, detokenisation.
	StepOverhead time.Duration
	// WeightRead is the floor of any forward pass: model weights / HBM
	// bandwidth.
	WeightRead time.Duration
	// PrefillPerToken is the compute time of one prefill token.
	PrefillPerToken time.Duration
	// DecodePerSeq is the extra time per decoding sequence in a step.
	DecodePerSeq time.Duration
}

// StepTime returns the modelled duration of a step that computes
// prefillTokens prompt tokens and decodeSeqs decode tokens.
func (p Profile) StepTime(prefillTokens, decodeSeqs int) time.Duration {
	if prefillTokens <= 0 && decodeSeqs <= 0 {
		return 0
	}
	fwd := time.Duration(prefillTokens) * p.PrefillPerToken
	fwd = max(fwd, p.WeightRead)
	return p.StepOverhead + fwd + time.Duration(decodeSeqs)*p.DecodePerSeq
}

// Validate reports whether the profile's durations are usable.
func (p Profile) Validate() error {
	if p.StepOverhead < 0 || p.WeightRead < 0 || p.PrefillPerToken < 0 || p.DecodePerSeq < 0 {
		return fmt.Errorf("%w: profile %q has a negative duration", ErrInvalidConfig, p.Name)
	}
	if p.StepTime(1, 0) <= 0 || p.StepTime(0, 1) <= 0 {
		return fmt.Errorf("%w: profile %q gives zero-length steps", ErrInvalidConfig, p.Name)
	}
	return nil
}

// ProfileL20Qwen27BFP8 approximates the seed study's replica: Qwen3.8-27B-FP8
// (dense, text only, MTP off) on one NVIDIA L20 48 GB, max-num-seqs 8.
//
// Calibration and sources:
//   - Hardware: NVIDIA's L20 datasheet lists 119.5 TFLOPS FP16/BF16 and 239
//     TFLOPS FP8 tensor throughput, and 864 GB/s of GDDR6 bandwidth.
//   - Prefill is compute bound: 2 FLOP per parameter per token = 54
//     GFLOP/token. PrefillPerToken = 0.32 ms/token is ~169 TFLOPS effective,
//     ~71% of the 239 TFLOPS FP8 figure. (If that figure were with sparsity,
//     0.32 ms would exceed the dense peak; 119.5 TFLOPS at ~85% would give
//     0.54 ms/token.) 0.32 ms was chosen because it is what reproduces the
//     seed's measurements under its load (TestCalibrationUnderLoad, fake
//     clock, one replica at the seed's per-replica rates): with 0.54 ms the
//     hot replica's TTFT P95 comes out at ~12 s against the seed's 8.3 s,
//     with 0.32 ms at ~8.6 s (block 1568); cold phases come out at ~8 s against the
//     seed's 5.6–9.2 s. A seed prompt (~5K tokens with cl100k: a 256 hex
//     salt, "Document N", the sentence ×300 and the question) then prefills
//     cold in ≈1.6 s on an idle replica.
//   - Decode is memory bound: ~27 GB of FP8 weights / 864 GB/s ≈ 31 ms per
//     forward pass (WeightRead), plus ~3 ms per sequence for KV reads and
//     sampling and ~6 ms fixed step overhead, so a batch of 8 decodes in
//     ≈61 ms. The seed measured TPOT P95 58.5–60.4 ms in the warm phases
//     (little prefill interference) and 59.8 ms (prefix-cache) vs 71.6 ms
//     (least-request, more cold prefills mixed into decode steps) in the
//     50% hotspot at 1.6 RPS.
//   - Warm TTFT: the seed's warm phases show TTFT P95 ≈ 0.33 s at a 93%
//     token hit rate. Its hybrid model caches attention in 1,568-token
//     blocks, so ~350 tokens stay uncached: 6 ms + 350×0.32 ms ≈ 0.12 s plus
//     waiting for the running decode step. With --block-size 1568 the
//     simulator reproduces that granularity (and the seed's 93% token hit
//     rate); with the default 16 only a few tokens stay uncached and an idle
//     warm TTFT is ≈40 ms.
var ProfileL20Qwen27BFP8 = Profile{
	Name:            "l20-qwen27b-fp8",
	StepOverhead:    6 * time.Millisecond,
	WeightRead:      31 * time.Millisecond,
	PrefillPerToken: 320 * time.Microsecond,
	DecodePerSeq:    3 * time.Millisecond,
}

// ProfileFast is for tests: steps of a few hundred microseconds.
var ProfileFast = Profile{
	Name:            "fast",
	StepOverhead:    50 * time.Microsecond,
	WeightRead:      200 * time.Microsecond,
	PrefillPerToken: 100 * time.Nanosecond,
	DecodePerSeq:    20 * time.Microsecond,
}

var profiles = map[string]Profile{
	ProfileL20Qwen27BFP8.Name: ProfileL20Qwen27BFP8,
	ProfileFast.Name:          ProfileFast,
}

// LookupProfile returns the named built-in profile.
func LookupProfile(name string) (Profile, error) {
	p, ok := profiles[name]
	if !ok {
		return Profile{}, fmt.Errorf("%w: %q (known: %v)", ErrUnknownProfile, name, ProfileNames())
	}
	return p, nil
}

// ProfileNames lists the built-in profiles.
func ProfileNames() []string {
	names := make([]string, 0, len(profiles))
	for n := range profiles {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
