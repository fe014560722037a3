package route

import (
	"math/bits"
	"math/rand/v2"
)

var _ rand.Source = (*Rand)(nil)

// Rand is a small, allocation-free, deterministic pseudo-random generator
// (SplitMix64). Strategies draw every random choice from the Rand passed to
// Pick, so a decision is reproducible from the seed. A Rand is not safe for
// concurrent use: keep one per request or per goroutine (it is a plain value
// of 8 bytes; NewRand on the stack costs nothing).
//
// Rand implements math/rand/v2's Source, so rand.New(&r) works where a
// *rand.Rand is wanted.
type Rand struct{ state uint64 }

// NewRand returns a generator seeded with seed.
func NewRand(seed uint64) Rand { return Rand{state: seed} }

// Uint64 returns the next 64 pseudo-random bits.
func (r *Rand) Uint64() uint64 {
	r.state += 0x9e3779b97f4a7c15
	z := r.state
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// IntN returns a uniform integer in [0, n). It panics if n <= 0.
func (r *Rand) IntN(n int) int {
	if n <= 0 {
		panic("route: Rand.IntN with n <= 0")
	}
	// Lemire's multiply-shift with rejection: unbiased, usually one draw.
	bound := uint64(n)
	hi, lo := bits.Mul64(r.Uint64(), bound)
	if lo < bound {
		threshold := -bound % bound
		for lo < threshold {
			hi, lo = bits.Mul64(r.Uint64(), bound)
		}
	}
	return int(hi)
}

// mix64 is a strong 64-bit finalizer (the SplitMix64 output function), used
// to spread caller-supplied keys before they meet the ring.
func mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// Float64 returns a uniform float in [0, 1).
func (r *Rand) Float64() float64 {
	return float64(r.Uint64()>>11) / (1 << 53)
}
