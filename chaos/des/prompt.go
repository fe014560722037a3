package des

import (
	"strings"
	"unsafe"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// prompts turns prompt text into engine tokens and gateway block keys,
// reusing the work of a shared prefix: the study's prompts of one prefix
// group repeat a ~29 KB document and differ only in a short tail, so the
// document's tokens and the keys of its full blocks are computed once and
// only the tail is tokenized and hashed per request.
//
// The result is by construction what a gateway computes for the full
// prompt (prompt_test.go checks it against full encodes):
//
//   - A prefix P is only split off at a position where the tokenizer's
//     encoding splits too (tokenizer's rule N: P ends in '\n' and the
//     prompt's next byte is printable ASCII other than space), so
//     Encode(prompt) == Encode(P) ++ Encode(prompt[len(P):]).
//   - Block keys are a chain: the keys of the blocks that lie wholly in
//     the cached tokens (or bytes) are the full prompt's first keys, and
//     the rest continue the chain from the last of them.
//
// Prefixes are found without knowing the study's prompt layout: prompts
// are grouped by their first line (the study's salt line); the second
// prompt of a group fixes P as the longest common prefix of the two cut
// back to a safe split. A prompt that does not extend P (same text, then a
// safe split) first shrinks P to a safe split it shares, so the prefix
// settles on what the whole group shares (the document); a prompt that
// still does not extend it takes the full path. The cache is bounded;
// clearing it changes no result.
type prompts struct {
	tok      tokenizer.Tokenizer
	hasher   index.Hasher
	root     index.BlockKey
	charKeys bool
	byFirst  map[string]*prefixEntry
	toks     []uint32 // reused token buffer (the engine copies prompts)
	// reused counts prompts that took the shared-prefix path; joined
	// those prepareSplit had to join.
	reused, joined uint64
}

// prefixEntry is one group's shared prefix.
type prefixEntry struct {
	// seen is the first prompt of the group until the second fixes text.
	seen string
	// text is the prefix P; empty until fixed (or none was found: done).
	text string
	done bool
	// toks are P's tokens; keys the keys of the full blocks within P's
	// tokens (token keys) or bytes (character keys).
	toks []uint32
	keys []index.BlockKey
	// base, when set, is a caller's prefix string (prepareSplit) whose
	// bytes equal text's first len(base) bytes (or text is a prefix of
	// it), so that the same string passed again matches by address.
	base string
}

const (
	// firstLineMax caps the grouping key.
	firstLineMax = 1024
	// minPrefix is the shortest prefix worth caching.
	minPrefix = 1024
	// maxPrefixEntries bounds the cache (one entry per prefix group;
	// phases use fresh salts, so old groups are never seen again).
	maxPrefixEntries = 4096
)

func newPrompts(tok tokenizer.Tokenizer, hasher index.Hasher, root index.BlockKey, charKeys bool) *prompts {
	return &prompts{tok: tok, hasher: hasher, root: root, charKeys: charKeys, byFirst: map[string]*prefixEntry{}}
}

// prepare returns the prompt's engine tokens and appends its block keys to
// keys[:0]. The tokens are valid until the next call.
func (p *prompts) prepare(prompt string, keys []index.BlockKey) ([]uint32, []index.BlockKey) {
	e := p.entry(prompt)
	if e != nil && e.text != "" && !extends(prompt, e.text) {
		// The group's prompts share less than its first two did (say,
		// two turns of one session), or this one does not split where
		// the prefix ends: shrink the prefix to a safe split this prompt
		// shares too. Prefixes only shrink, so this happens rarely.
		a := e.text
		*e = prefixEntry{seen: a}
		p.fix(e, prompt)
	}
	if e != nil && e.text != "" {
		if n := len(e.text); extends(prompt, e.text) {
			p.reused++
			p.toks = p.tok.Encode(append(p.toks[:0], e.toks...), prompt[n:])
			keys = append(keys[:0], e.keys...)
			parent := p.root
			if len(e.keys) > 0 {
				parent = e.keys[len(e.keys)-1]
			}
			bt := p.hasher.BlockTokens()
			if p.charKeys {
				keys = p.hasher.AppendKeysString(keys, parent, prompt[len(e.keys)*bt:])
			} else {
				keys = p.hasher.AppendKeys(keys, parent, p.toks[len(e.keys)*bt:])
			}
			return p.toks, keys
		}
	}
	p.toks = p.tok.Encode(p.toks[:0], prompt)
	if p.charKeys {
		keys = p.hasher.AppendKeysString(keys[:0], p.root, prompt)
	} else {
		keys = p.hasher.AppendKeys(keys[:0], p.root, p.toks)
	}
	return p.toks, keys
}

// prepareSplit is prepare for the prompt prefix+tail, without building it
// when the prompt takes the shared-prefix path: then only the bytes after
// the group's prefix (a sentence and the tail) are joined. The result is
// prepare(prefix+tail)'s (prompt_test.go checks it); any case the fast
// path does not cover takes prepare on the joined prompt. Callers pass
// the same prefix string for every request of a document, so the group's
// prefix is kept as a substring of it and recognised by its address.
func (p *prompts) prepareSplit(prefix, tail string, keys []index.BlockKey) ([]uint32, []index.BlockKey) {
	if prefix == "" {
		return p.prepare(tail, keys)
	}
	if tail == "" {
		return p.prepare(prefix, keys)
	}
	first := prefix[:min(len(prefix), firstLineMax)]
	nl := strings.IndexByte(first, '\n')
	if nl < 0 {
		return p.prepare(prefix+tail, keys) // the first line is not within prefix
	}
	first = first[:nl]
	e := p.byFirst[first]
	if e == nil || e.text == "" || !p.extendsSplit(prefix, tail, e) {
		keys = p.prepareJoined(prefix, tail, first, keys)
		return p.toks, keys
	}
	// prepare's shared-prefix path, on the bytes after n.
	n := len(e.text)
	bt := p.hasher.BlockTokens()
	from := n // the first byte the path reads
	if p.charKeys {
		from = min(from, len(e.keys)*bt)
	}
	var rest string // prompt[from:]
	if from < len(prefix) {
		rest = prefix[from:] + tail
	} else {
		rest = tail[from-len(prefix):]
	}
	p.reused++
	p.toks = p.tok.Encode(append(p.toks[:0], e.toks...), rest[n-from:])
	keys = append(keys[:0], e.keys...)
	parent := p.root
	if len(e.keys) > 0 {
		parent = e.keys[len(e.keys)-1]
	}
	if p.charKeys {
		keys = p.hasher.AppendKeysString(keys, parent, rest[len(e.keys)*bt-from:])
	} else {
		keys = p.hasher.AppendKeys(keys, parent, p.toks[len(e.keys)*bt:])
	}
	return p.toks, keys
}

// prepareJoined runs prepare on prefix+tail and, when the group's prefix
// then agrees with prefix over their common length, remembers prefix as
// its base so that later prompts of the group are recognised by address.
func (p *prompts) prepareJoined(prefix, tail, first string, keys []index.BlockKey) []index.BlockKey {
	p.joined++
	_, keys = p.prepare(prefix+tail, keys)
	if e := p.byFirst[first]; e != nil && e.text != "" {
		e.base = ""
		if m := min(len(e.text), len(prefix)); e.text[:m] == prefix[:m] {
			e.base = prefix
		}
	}
	return keys
}

// extendsSplit is extends(prefix+tail, e.text).
func (p *prompts) extendsSplit(prefix, tail string, e *prefixEntry) bool {
	n := len(e.text)
	total := len(prefix) + len(tail)
	if n > total {
		return false
	}
	// text == (prefix+tail)[:n], without joining: prefix's part by
	// address when it is the base, the rest by bytes.
	m := min(n, len(prefix))
	same := len(e.base) == len(prefix) && unsafe.StringData(e.base) == unsafe.StringData(prefix)
	if !same && e.text[:m] != prefix[:m] {
		return false
	}
	if n > m && e.text[m:] != tail[:n-m] {
		return false
	}
	if n == total {
		return true
	}
	at := func(i int) byte {
		if i < len(prefix) {
			return prefix[i]
		}
		return tail[i-len(prefix)]
	}
	// safeSplit(prompt, n), byte by byte.
	return n > 0 && n < total && at(n-1) == '\n' && at(n) > ' ' && at(n) < 0x7f
}

// entry returns the prompt's group entry, fixing its prefix on the
// group's second prompt; nil when the prompt has no usable first line.
func (p *prompts) entry(prompt string) *prefixEntry {
	first := prompt[:min(len(prompt), firstLineMax)]
	for i := 0; i < len(first); i++ {
		if first[i] == '\n' {
			first = first[:i]
			break
		}
	}
	if len(first) == len(prompt) {
		return nil // a single line: nothing to share
	}
	e := p.byFirst[first]
	if e == nil {
		if len(p.byFirst) >= maxPrefixEntries {
			clear(p.byFirst)
		}
		p.byFirst[first] = &prefixEntry{seen: prompt}
		return nil
	}
	if e.text == "" && !e.done {
		p.fix(e, prompt)
	}
	return e
}

// fix sets e's prefix from the common prefix of its first prompt and this
// one, cut back to a safe split.
func (p *prompts) fix(e *prefixEntry, prompt string) {
	a := e.seen
	e.seen, e.done = "", true
	l := 0
	for l < len(a) && l < len(prompt) && a[l] == prompt[l] {
		l++
	}
	// The split must be safe in both prompts: keep the byte after it
	// inside the common part.
	n := l - 1
	for n >= minPrefix && !safeSplit(prompt, n) {
		n--
	}
	if n < minPrefix {
		return
	}
	e.text = prompt[:n]
	e.toks = p.tok.Encode(nil, e.text)
	bt := p.hasher.BlockTokens()
	if p.charKeys {
		e.keys = p.hasher.AppendKeysString(nil, p.root, e.text[:len(e.text)/bt*bt])
	} else {
		e.keys = p.hasher.AppendKeys(nil, p.root, e.toks)
	}
}

// extends reports whether prompt is prefix, or prefix followed by a tail
// that encodes on its own.
func extends(prompt, prefix string) bool {
	return strings.HasPrefix(prompt, prefix) && (len(prompt) == len(prefix) || safeSplit(prompt, len(prefix)))
}

// safeSplit reports whether encoding text splits at n (0 < n < len(text)):
// the tokenizer's rule N, a newline followed by printable ASCII other than
// space. It holds for the byte tokenizer too.
func safeSplit(text string, n int) bool {
	return n > 0 && n < len(text) && text[n-1] == '\n' && text[n] > ' ' && text[n] < 0x7f
}
