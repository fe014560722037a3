package route

import "fmt"

// OffloadConfig prices a prefix an engine holds in an offload tier (CPU
// memory, disk) rather than on its GPU: the engine loads those blocks
// instead of recomputing them, which costs their KV bytes over the tier's
// bandwidth. Bandwidths are in prompt tokens per second, so they do not
// depend on the model's KV bytes per token being known here.
type OffloadConfig struct {
	// CPULoadTokensPerSecond is how fast the engine loads offloaded KV from
	// host memory. Default 50,000: a ~30B model with grouped-query
	// attention keeps about 250 KB of KV per token (64 layers × 8 KV heads
	// × 128 dims × K and V × 2 bytes), and a PCIe 4.0 x16 link moves about
	// 12–25 GB/s in practice, 50,000–100,000 tokens/s; the default takes
	// the low end. Must be > 0.
	CPULoadTokensPerSecond float64
	// DiskLoadTokensPerSecond is the same from disk. Default 10,000 (about
	// 2.5 GB/s, one NVMe drive's sequential read at the same KV size).
	// Must be > 0.
	DiskLoadTokensPerSecond float64
}

// DefaultOffloadConfig returns the defaults documented on OffloadConfig.
func DefaultOffloadConfig() OffloadConfig {
	return OffloadConfig{CPULoadTokensPerSecond: 50_000, DiskLoadTokensPerSecond: 10_000}
}

// Validate reports a bandwidth out of range.
func (c OffloadConfig) Validate() error {
	if !positiveFinite(c.CPULoadTokensPerSecond) || !positiveFinite(c.DiskLoadTokensPerSecond) {
		return fmt.Errorf("%w: offload load rates %v and %v tokens/s must be > 0",
			ErrInvalidConfig, c.CPULoadTokensPerSecond, c.DiskLoadTokensPerSecond)
	}
	return nil
}

// PrefillSeconds is the prefill work of req on a replica that holds its
// first gpu blocks on the GPU and the next cpu and then disk blocks in its
// offload tiers (index.MatchTiers), at prefillSecPerToken seconds per
// recomputed engine token (block counts and loaded are in the keys'
// units, converted by Request.UnitsPerToken): the offloaded blocks are loaded at the tier's
// bandwidth (a block is never priced above recomputing it, which the
// engine's connector could do instead) and the rest of the uncached prompt
// is computed. It also returns the tokens priced as loads. With cpu and
// disk 0 it is req.UncachedTokens(gpu) × prefillSecPerToken, the cost
// model's recompute term; this is the term that replaces it for engines
// with an offload tier; Cost.estimate calls it. Pure; safe for
// concurrent use.
func (c OffloadConfig) PrefillSeconds(req *Request, gpu, cpu, disk int, prefillSecPerToken float64) (seconds float64, loaded int) {
	uncached := req.UncachedTokens(gpu)
	gpu = min(max(gpu, 0), req.TotalBlocks)
	left := req.TotalBlocks - gpu
	cpuTok := min(max(cpu, 0), left) * req.BlockTokens
	diskTok := min(max(disk, 0), left-cpuTok/max(req.BlockTokens, 1)) * req.BlockTokens
	load := func(units int, rate float64) float64 {
		tokens := req.tokens(units)
		return min(tokens/rate, tokens*prefillSecPerToken)
	}
	seconds = load(cpuTok, c.CPULoadTokensPerSecond) + load(diskTok, c.DiskLoadTokensPerSecond)
	loaded = cpuTok + diskTok
	return seconds + req.tokens(uncached-loaded)*prefillSecPerToken, loaded
}

// offloadedTokens is the prompt, in the keys' units, that cand loads from
// its offload tiers instead of recomputing: its CPU and then disk run
// after the GPU match, clipped to the prompt's blocks.
func (r *Request) offloadedTokens(cand *Candidate) int {
	gpu := min(max(cand.Matched, 0), r.TotalBlocks)
	left := r.TotalBlocks - gpu
	cpu := min(max(cand.OffloadCPU, 0), left)
	disk := min(max(cand.OffloadDisk, 0), left-cpu)
	return (cpu + disk) * r.BlockTokens
}

// PricesTiers implements TierPricer: cost prices offloaded blocks unless
// both tiers' load rates are negative (CostConfig).
func (c *Cost) PricesTiers() bool {
	_, cpu, disk := c.model.cfg.offload()
	return cpu || disk
}

var _ TierPricer = (*Cost)(nil)

// tierBlocks is cand's offloaded run as cost prices it: a tier whose load
// rate is negative (CostConfig) counts as not held.
func (c *Cost) tierBlocks(cand *Candidate) (o OffloadConfig, cpu, disk int) {
	if cand.OffloadCPU <= 0 && cand.OffloadDisk <= 0 {
		return o, 0, 0
	}
	o, cpuOn, diskOn := c.model.cfg.offload()
	if cpuOn {
		cpu = cand.OffloadCPU
	}
	if diskOn {
		disk = cand.OffloadDisk
	}
	return o, cpu, disk
}

// ownPrefill is req's own prefill on cand at p seconds per engine token:
// the seconds, and the engine tokens it computes (the uncached prompt less
// what cand loads from an offload tier).
func (c *Cost) ownPrefill(req *Request, cand *Candidate, p float64) (seconds, computed float64) {
	uncached := req.UncachedTokens(cand.Matched)
	o, cpu, disk := c.tierBlocks(cand)
	if cpu == 0 && disk == 0 {
		t := req.tokens(uncached)
		return t * p, t
	}
	seconds, loaded := o.PrefillSeconds(req, cand.Matched, cpu, disk, p)
	return seconds, req.tokens(uncached - loaded)
}

// computedUnits is the uncached prompt cand computes (not loads), in the
// keys' units.
func (c *Cost) computedUnits(req *Request, cand *Candidate) int {
	uncached := req.UncachedTokens(cand.Matched)
	_, cpu, disk := c.tierBlocks(cand)
	if cpu == 0 && disk == 0 {
		return uncached
	}
	tc := *cand
	tc.OffloadCPU, tc.OffloadDisk = cpu, disk
	return uncached - req.offloadedTokens(&tc)
}
