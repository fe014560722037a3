package study

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"

	"github.com/zeebo/xxh3"
)

// Sentence is the seed study's body sentence, repeated SentenceRepeats
// times in every prompt.
const Sentence = "The service tracks request latency, token throughput, cache utilization, and healthy replicas."

// SentenceRepeats is how often Sentence appears in a prompt.
const SentenceRepeats = 300

// QuestionText follows the six-digit request number on a prompt's last line.
const QuestionText = "Explain the operational tradeoffs in detail."

// SaltHexLen is the length of a prefix salt in hexadecimal characters.
const SaltHexLen = 256

// body is the shared document body, built once.
var body = bodyText(SentenceRepeats)

// bodies holds the bodies of other repeat counts (prompt sizing), built
// once each.
var bodies sync.Map // int -> string

func bodyText(repeats int) string {
	return strings.TrimSuffix(strings.Repeat(Sentence+"\n", repeats), "\n")
}

// bodyOf returns the body of repeats sentences (0: SentenceRepeats).
func bodyOf(repeats int) string {
	if repeats == 0 || repeats == SentenceRepeats {
		return body
	}
	if b, ok := bodies.Load(repeats); ok {
		return b.(string)
	}
	b, _ := bodies.LoadOrStore(repeats, bodyText(repeats))
	return b.(string)
}

// Document is one prefix group as a phase uses it: the salt that isolates it
// from every other phase and the document number printed in the prompt.
type Document struct {
	// Number is printed as "Document <Number>".
	Number int
	// Salt is SaltHexLen hexadecimal characters, distinct per phase,
	// document and initialisation attempt.
	Salt string
	// Repeats is how often Sentence appears in the body; 0 means
	// SentenceRepeats (the seed's). Prompt sizing (Config.BodyRepeats)
	// sets it so that a prompt is as long in the engine's tokens as the
	// seed's was in its own.
	Repeats int
}

// Prefix returns the part of every prompt of this document that precedes the
// question line: the salt, the "Document N" line and the repeated sentence,
// each on its own line.
func (d Document) Prefix() string {
	body := bodyOf(d.Repeats)
	var b strings.Builder
	b.Grow(len(d.Salt) + len(body) + 32)
	b.WriteString(d.Salt)
	b.WriteString("\nDocument ")
	fmt.Fprintf(&b, "%d", d.Number)
	b.WriteByte('\n')
	b.WriteString(body)
	return b.String()
}

// Prompt returns the seed's prompt for request number q (printed with six
// digits): Prefix, a newline and "Question NNNNNN: Explain the operational
// tradeoffs in detail.".
func (d Document) Prompt(q int) string {
	return d.Prefix() + "\n" + QuestionLine(q)
}

// firstTurnPrompt is TurnPrompt's first turn for a document whose Prefix
// is prefix.
func firstTurnPrompt(prefix string, session int) string {
	return fmt.Sprintf("%s\n\nSession %06d.\nUser: %s\nAssistant:", prefix, session, QuestionLine(session))
}

// QuestionLine returns "Question NNNNNN: Explain the operational tradeoffs
// in detail." for request number q.
func QuestionLine(q int) string {
	return fmt.Sprintf("Question %06d: %s", q, QuestionText)
}

// mix derives a 64-bit stream seed from the study seed and labels, so that
// every (phase, document, attempt) gets an independent, reproducible stream.
func mix(seed uint64, labels ...string) uint64 {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], seed)
	h := xxh3.New()
	_, _ = h.Write(b[:])
	for _, l := range labels {
		_, _ = h.WriteString(l)
		_, _ = h.Write([]byte{0})
	}
	return h.Sum64()
}

// Salt returns the deterministic salt for document doc of the phase named
// phase, initialisation attempt attempt, under the study seed.
func Salt(seed uint64, phase string, doc, attempt int) string {
	s := mix(seed, "salt", phase, fmt.Sprint(doc), fmt.Sprint(attempt))
	r := rand.New(rand.NewPCG(s, s^0x9e3779b97f4a7c15))
	raw := make([]byte, SaltHexLen/2)
	for i := 0; i < len(raw); i += 8 {
		binary.LittleEndian.PutUint64(raw[i:], r.Uint64())
	}
	return hex.EncodeToString(raw)
}

// Documents returns n documents numbered first, first+1, ... with salts for
// the given phase and attempt.
func Documents(seed uint64, phase string, first, n, attempt int) []Document {
	docs := make([]Document, n)
	for i := range docs {
		docs[i] = Document{Number: first + i, Salt: Salt(seed, phase, first+i, attempt)}
	}
	return docs
}

// GroupSequence returns the logical prefix group of each of n arrivals. The
// hot group (0) gets hot arrivals (hot <= 0: no hot group, all groups
// share n as evenly as possible); the remaining arrivals are spread as
// evenly as possible over the other groups, lower-numbered groups taking the
// remainder. The order is shuffled with a stream derived from seed and key,
// so every strategy in a round sees the same sequence.
func GroupSequence(seed uint64, key string, groups, n, hot int) []int {
	seq := make([]int, 0, n)
	if hot > 0 {
		for range hot {
			seq = append(seq, 0)
		}
		seq = spread(seq, 1, groups-1, n-hot)
	} else {
		seq = spread(seq, 0, groups, n)
	}
	s := mix(seed, "sequence", key)
	r := rand.New(rand.NewPCG(s, ^s))
	r.Shuffle(len(seq), func(i, j int) { seq[i], seq[j] = seq[j], seq[i] })
	return seq
}

// spread appends n arrivals over groups first..first+k-1, as evenly as
// possible.
func spread(seq []int, first, k, n int) []int {
	if k <= 0 {
		return seq
	}
	for g := range k {
		c := n / k
		if g < n%k {
			c++
		}
		for range c {
			seq = append(seq, first+g)
		}
	}
	return seq
}

// followUps are the user turns appended to multi-turn sessions after the
// first question.
var followUps = []string{
	"Which of those tradeoffs matters most when the cache is cold?",
	"How would you change the setup if one document became a hot spot?",
	"Summarise the latency implications for the tail of the distribution.",
	"Give a short checklist an operator could follow during a rollout.",
}

// TurnPrompt returns the prompt of turn t (1-based) of a multi-turn session
// over document d: turn 1 is the document prefix followed by the session's
// first user turn; every later turn is the previous turn's prompt, the
// answer the engine gave to it, and a new user turn.
func TurnPrompt(d Document, session, t int, prev, answer string) string {
	if t <= 1 {
		return firstTurnPrompt(d.Prefix(), session)
	}
	return fmt.Sprintf("%s%s\nUser: %s\nAssistant:", prev, answer, followUps[(t-2)%len(followUps)])
}
