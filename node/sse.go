package node

import "bytes"

// sseLineCap bounds how much of one SSE line sseTally keeps: enough for
// the fields it reads (choices opens an OpenAI chunk; a usage-only chunk
// is a few hundred bytes), so a long content line costs no more.
const sseLineCap = 1024

// sseTally reads an OpenAI-style event stream as it is relayed (the bytes
// are not changed) and tells the cost model what it showed: content
// events (a non-empty choices list) are output; the usage-only event
// (choices: []) and [DONE] are not. Lines may span reads.
type sseTally struct {
	line        [sseLineCap]byte
	n           int   // bytes of the current line kept in line
	content     int   // content events seen
	firstAt     int64 // unix nanos of the read that ended the first content event
	lastAt      int64 // ... and the last
	usageTokens int   // last usage.completion_tokens seen, when hasUsage
	hasUsage    bool
	usage       usageFigures // prompt and cached tokens of the last usage seen
}

// feed takes one relayed read, received at now (unix nanos). When it
// ends a content event it tells rep (when not nil) that a token came
// (replica.sawToken).
func (t *sseTally) feed(chunk []byte, now int64, rep *replica) {
	prev := t.lastAt
	t.feedLines(chunk, now)
	if rep != nil && t.lastAt == now && prev != now {
		rep.sawToken(now, prev)
	}
}

// feedLines splits one read into lines.
func (t *sseTally) feedLines(chunk []byte, now int64) {
	for len(chunk) > 0 {
		i := bytes.IndexByte(chunk, '\n')
		if i < 0 {
			t.n += copy(t.line[t.n:], chunk)
			return
		}
		t.n += copy(t.line[t.n:], chunk[:i])
		t.endLine(now)
		chunk = chunk[i+1:]
	}
}

var (
	ssePrefix      = []byte("data:")
	sseDone        = []byte("[DONE]")
	jsonChoices    = []byte(`"choices"`)
	jsonCompletion = []byte(`"completion_tokens"`)
)

func (t *sseTally) endLine(now int64) {
	l := bytes.TrimSpace(t.line[:t.n])
	t.n = 0
	if !bytes.HasPrefix(l, ssePrefix) {
		return
	}
	l = bytes.TrimSpace(l[len(ssePrefix):])
	if bytes.Equal(l, sseDone) {
		return
	}
	if v, ok := jsonUintAfter(l, jsonCompletion); ok {
		t.usageTokens, t.hasUsage = v, true
		t.usage = parseUsage(l)
	}
	if !nonEmptyChoices(l) {
		return
	}
	t.content++
	if t.firstAt == 0 {
		t.firstAt = now
	}
	t.lastAt = now
}

// nonEmptyChoices reports whether event JSON l has "choices": [ x... ].
func nonEmptyChoices(l []byte) bool {
	i := bytes.Index(l, jsonChoices)
	if i < 0 {
		return false
	}
	rest := skipJSONSpace(l[i+len(jsonChoices):])
	if len(rest) == 0 || rest[0] != ':' {
		return false
	}
	rest = skipJSONSpace(rest[1:])
	if len(rest) == 0 || rest[0] != '[' {
		return false
	}
	rest = skipJSONSpace(rest[1:])
	return len(rest) > 0 && rest[0] != ']'
}

// jsonUintAfter reads the unsigned integer value of key in l ("key": 12);
// ok is false when the key is missing or its value is not a number (null).
func jsonUintAfter(l, key []byte) (v int, ok bool) {
	i := bytes.Index(l, key)
	if i < 0 {
		return 0, false
	}
	rest := skipJSONSpace(l[i+len(key):])
	if len(rest) == 0 || rest[0] != ':' {
		return 0, false
	}
	rest = skipJSONSpace(rest[1:])
	for _, c := range rest {
		if c < '0' || c > '9' || v > 1<<40 {
			break
		}
		v, ok = v*10+int(c-'0'), true
	}
	return v, ok
}

func skipJSONSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\r' || b[0] == '\n') {
		b = b[1:]
	}
	return b
}
