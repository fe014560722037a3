package tokenizer

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
)

// ErrNotCacheable is returned by NewCached for a tokenizer whose safe split
// points this package does not know.
var ErrNotCacheable = errors.New("tokenizer: tokenizer cannot be prefix-cached")

// ErrInvalidConfig is returned by CachedConfig.Validate.
var ErrInvalidConfig = errors.New("tokenizer: invalid config")

// CachedConfig configures a Cached tokenizer.
type CachedConfig struct {
	// MaxBytes bounds the memory the cache accounts for: cached text, 4
	// bytes per cached token and a fixed overhead per entry. The least
	// recently used entries are evicted beyond it. Default 64 MiB: about
	// 1,100 distinct seed-shaped 28 KB documents (text, ~5,000 tokens and
	// ~56 entries each), small next to a gateway's other state.
	MaxBytes int64
	// SegmentBytes is the stride between cached split points: the cache
	// keeps an entry at the first safe split at least SegmentBytes after
	// the previous one. A prompt that diverges from every cached one is
	// re-encoded from up to about SegmentBytes before the divergence.
	// Default 512: a few µs of native encoding (fast.go) at most, and
	// about 56 entries, so 56 map lookups, for a 28 KB prompt.
	SegmentBytes int
	// MaxTailProbes bounds how many line starts after the last matching
	// stride point are tried as cached "tails" (the last line start of an
	// earlier prompt, e.g. where its question begins). Default 32.
	MaxTailProbes int
}

// DefaultCachedConfig returns the defaults documented on CachedConfig.
func DefaultCachedConfig() CachedConfig {
	return CachedConfig{MaxBytes: 64 << 20, SegmentBytes: 512, MaxTailProbes: 32}
}

// Validate reports a field out of range, wrapping ErrInvalidConfig.
func (c CachedConfig) Validate() error {
	switch {
	case c.MaxBytes < 1:
		return fmt.Errorf("%w: MaxBytes %d < 1", ErrInvalidConfig, c.MaxBytes)
	case c.SegmentBytes < 16:
		return fmt.Errorf("%w: SegmentBytes %d < 16", ErrInvalidConfig, c.SegmentBytes)
	case c.MaxTailProbes < 0:
		return fmt.Errorf("%w: MaxTailProbes %d < 0", ErrInvalidConfig, c.MaxTailProbes)
	}
	return nil
}

// CacheStats are a Cached tokenizer's counters since creation. Counts are
// of Encode calls unless named otherwise.
type CacheStats struct {
	Hits         uint64 // reused a cached prefix
	Misses       uint64 // had split points but no cached prefix
	Uncacheable  uint64 // had no safe split point; encoded in full, not cached
	HitBytes     uint64 // text bytes whose tokens came from the cache
	EncodedBytes uint64 // text bytes encoded by the wrapped tokenizer
	Evictions    uint64 // entries evicted to respect MaxBytes
	Entries      int    // entries now cached
	Bytes        int64  // accounted bytes now cached
}

// entryOverhead approximates an entry's fixed memory: the struct, its map
// slot and its key.
const entryOverhead = 160

// segKey names a cached prefix: the entry for the prefix before the
// segment (0 for the start of the text) and the segment's text.
type segKey struct {
	parent uint64
	seg    string
}

// entry caches the tokens of one segment. Its id stands for the whole
// prefix ending with seg: ids are never reused, so equal keys mean equal
// prefixes. Fields other than the list links never change after insert.
type entry struct {
	key        segKey
	id         uint64
	toks       []uint32
	prev, next *entry
}

func (e *entry) cost() int64 { return int64(len(e.key.seg) + 4*len(e.toks) + entryOverhead) }

// Cached is a Tokenizer that caches the tokens of prompt prefixes, so a
// prompt whose long prefix was seen before costs only the encoding of its
// new part. Its output is token for token that of the wrapped tokenizer:
// it cuts text only at safe split points (see split.go), where encoding
// the two sides separately provably equals encoding the whole.
//
// For each text Encode considers "stride" split points (the first safe
// split at least SegmentBytes after the previous one, from the start) and,
// after the last stride point, line starts. It looks the prefix up stride
// point by stride point, then tries the line starts from the last one
// backwards, encodes only what follows the longest cached prefix, and
// caches the new stride points and the last line start. A cache entry is
// keyed by the exact prefix text (its parent entry and its own segment),
// so a hit is never a hash collision.
//
// Cached is safe for concurrent use. One mutex guards the cache; the
// wrapped tokenizer runs outside it. It starts no goroutines.
type Cached struct {
	inner Tokenizer
	cfg   CachedConfig

	mu     sync.Mutex
	m      map[segKey]*entry
	lru    entry // sentinel: lru.next is the most recently used
	bytes  int64
	nextID uint64

	hits, misses, uncacheable, hitBytes, encodedBytes, evictions atomic.Uint64
}

var (
	_ Tokenizer = (*Cached)(nil)
	_ Decoder   = (*Cached)(nil)
)

// NewCached wraps inner, which must be Bytes, the tiktoken tokenizer from
// New or an HF tokenizer whose added tokens hold no space or newline
// (otherwise the error wraps ErrNotCacheable), with a prefix cache
// configured by cfg (an invalid cfg returns an error wrapping
// ErrInvalidConfig).
func NewCached(inner Tokenizer, cfg CachedConfig) (*Cached, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	switch t := inner.(type) {
	case Bytes, *Tiktoken:
	case *HF:
		if !t.splitSafe() {
			return nil, fmt.Errorf("%w: %s has an added token holding a space or newline", ErrNotCacheable, t.Name())
		}
	default:
		return nil, fmt.Errorf("%w: %T", ErrNotCacheable, inner)
	}
	c := &Cached{inner: inner, cfg: cfg, m: make(map[segKey]*entry)}
	c.lru.next, c.lru.prev = &c.lru, &c.lru
	return c, nil
}

// Name implements Tokenizer: the wrapped tokenizer's name.
func (c *Cached) Name() string { return c.inner.Name() }

// Decode implements Decoder with the wrapped tokenizer.
func (c *Cached) Decode(dst []byte, tokens []uint32) ([]byte, error) {
	return c.inner.(Decoder).Decode(dst, tokens)
}

// Stats returns the counters. It is safe to call concurrently with Encode.
func (c *Cached) Stats() CacheStats {
	c.mu.Lock()
	n, b := len(c.m), c.bytes
	c.mu.Unlock()
	return CacheStats{
		Hits:         c.hits.Load(),
		Misses:       c.misses.Load(),
		Uncacheable:  c.uncacheable.Load(),
		HitBytes:     c.hitBytes.Load(),
		EncodedBytes: c.encodedBytes.Load(),
		Evictions:    c.evictions.Load(),
		Entries:      n,
		Bytes:        b,
	}
}

// newSeg is a segment encoded by this call, to be cached.
type newSeg struct {
	end    int // split point ending the segment
	tokLo  int // its tokens are dst[tokLo:tokHi] ...
	tokHi  int
	prefix []uint32 // ... preceded by these (a cached tail's tokens)
}

// Encode implements Tokenizer.
func (c *Cached) Encode(dst []uint32, text string) []uint32 {
	dst, _ = c.EncodeLimited(dst, text, Limit{})
	return dst
}

// EncodeLimited implements LimitedEncoder: Encode within lim. Segments cut
// short by lim are not cached.
func (c *Cached) EncodeLimited(dst []uint32, text string, lim Limit) ([]uint32, bool) {
	base := len(dst)
	seg := c.cfg.SegmentBytes
	next := nextSafeSplit(text, seg)
	if next < 0 && prevNewlineSplit(text, 0, len(text)) < 0 {
		c.uncacheable.Add(1)
		c.encodedBytes.Add(uint64(len(text)))
		return encodeLimited(c.inner, dst, text, lim)
	}

	// Look up the longest cached prefix.
	var pathBuf [96]*entry
	path := pathBuf[:0]
	var parent *entry
	pos := 0
	c.mu.Lock()
	for next > 0 {
		e := c.m[segKey{idOf(parent), text[pos:next]}]
		if e == nil {
			break
		}
		path = append(path, e)
		parent, pos = e, next
		next = nextSafeSplit(text, pos+seg)
	}
	limit := len(text)
	if next > 0 {
		limit = next
	}
	var tail *entry
	tailPos := pos
	probes := 0
	for p := prevNewlineSplit(text, pos, limit); p > 0 && probes < c.cfg.MaxTailProbes; p = prevNewlineSplit(text, pos, p) {
		probes++
		if e := c.m[segKey{idOf(parent), text[pos:p]}]; e != nil {
			tail, tailPos = e, p
			break
		}
	}
	if tail != nil {
		c.touch(tail)
	}
	for i := len(path) - 1; i >= 0; i-- {
		c.touch(path[i])
	}
	c.mu.Unlock()

	// Cached tokens are immutable: copy them without the lock.
	if tailPos > 0 {
		c.hits.Add(1)
		c.hitBytes.Add(uint64(tailPos))
	} else {
		c.misses.Add(1)
	}
	n := 0
	for _, e := range path {
		n += len(e.toks)
	}
	if tail != nil {
		n += len(tail.toks)
	}
	dst = growU32(dst, n+(len(text)-tailPos)/3)
	for _, e := range path {
		dst = append(dst, e.toks...)
	}
	var tailToks []uint32
	if tail != nil {
		tailToks = tail.toks
		dst = append(dst, tailToks...)
	}

	// Encode the rest segment by segment, noting the segments to cache:
	// the stride points from next on, then the last line start.
	var segBuf [8]newSeg
	segs := segBuf[:0]
	cur := tailPos
	last := pos // last stride point covered
	// inner encodes text[cur:end] within what is left of lim; stop reports
	// that lim was reached (the tokens so far are a prefix of Encode's).
	stop := false
	inner := func(end int) {
		sub := lim
		if lim.MaxTokens > 0 {
			if sub.MaxTokens = lim.MaxTokens - (len(dst) - base); sub.MaxTokens <= 0 {
				stop = true
				return
			}
		}
		dst, stop = encodeLimited(c.inner, dst, text[cur:end], sub)
	}
	for next > 0 && !stop {
		lo := len(dst)
		inner(next)
		if stop {
			break
		}
		s := newSeg{end: next, tokLo: lo, tokHi: len(dst)}
		if cur == tailPos && tail != nil {
			s.prefix = tailToks
		}
		segs = append(segs, s)
		cur, last = next, next
		next = nextSafeSplit(text, next+seg)
	}
	if t := prevNewlineSplit(text, max(last, tailPos), len(text)); t > 0 && !stop {
		lo := len(dst)
		if inner(t); !stop {
			s := newSeg{end: t, tokLo: lo, tokHi: len(dst)}
			if cur == tailPos && tail != nil {
				s.prefix = tailToks
			}
			segs = append(segs, s)
			cur = t
		}
	}
	if !stop {
		inner(len(text))
	}
	c.encodedBytes.Add(uint64(len(text) - tailPos))

	if len(segs) > 0 {
		c.insert(parent, pos, text, segs, dst)
	}
	if lim.MaxTokens > 0 && len(dst)-base > lim.MaxTokens {
		dst, stop = dst[:base+lim.MaxTokens], true
	}
	return dst, stop
}

// insert caches segs, a chain of segments starting at text[pos:] whose
// prefix text[:pos] is parent's (nil for pos 0). The new entries are
// prepared outside the lock.
func (c *Cached) insert(parent *entry, pos int, text string, segs []newSeg, dst []uint32) {
	var eBuf [8]*entry
	es := eBuf[:0]
	for _, s := range segs {
		toks := make([]uint32, 0, len(s.prefix)+s.tokHi-s.tokLo)
		toks = append(toks, s.prefix...)
		toks = append(toks, dst[s.tokLo:s.tokHi]...)
		es = append(es, &entry{key: segKey{seg: strings.Clone(text[pos:s.end])}, toks: toks})
		pos = s.end
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if parent != nil && c.m[parent.key] != parent {
		return // evicted meanwhile: the new entries could never be reached
	}
	for _, e := range es {
		if e.cost() > c.cfg.MaxBytes {
			return
		}
		e.key.parent = idOf(parent)
		if old := c.m[e.key]; old != nil {
			c.touch(old) // another Encode cached it first
			parent = old
			continue
		}
		c.nextID++
		e.id = c.nextID
		c.m[e.key] = e
		c.bytes += e.cost()
		c.touch(e)
		parent = e
		for c.bytes > c.cfg.MaxBytes {
			c.evict(c.lru.prev)
		}
		if c.m[parent.key] != parent {
			return
		}
	}
}

// idOf is the key parent for the segment after e (0 at the text start).
func idOf(e *entry) uint64 {
	if e == nil {
		return 0
	}
	return e.id
}

// touch makes e the most recently used entry. c.mu is held.
func (c *Cached) touch(e *entry) {
	if e.prev != nil {
		e.prev.next, e.next.prev = e.next, e.prev
	}
	e.prev, e.next = &c.lru, c.lru.next
	c.lru.next.prev = e
	c.lru.next = e
}

// evict removes e. c.mu is held.
func (c *Cached) evict(e *entry) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
	delete(c.m, e.key)
	c.bytes -= e.cost()
	c.evictions.Add(1)
}
