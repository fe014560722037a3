package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"strings"
)

// seedSentence is the sentence the seed study repeats 300 times.
const seedSentence = "The service tracks request latency, token throughput, cache utilization, and healthy replicas.\n"

// seedPrompt builds a prompt shaped like the seed study's: 256 hex chars of
// salt, "Document N", the sentence ×300, and a numbered question.
func seedPrompt(salt string, doc, question int) string {
	var b strings.Builder
	b.WriteString(salt)
	fmt.Fprintf(&b, "\nDocument %d\n", doc)
	b.WriteString(strings.Repeat(seedSentence, 300))
	fmt.Fprintf(&b, "Question %06d: Explain the operational tradeoffs in detail.", question)
	return b.String()
}

// seedSalt returns 256 hex characters drawn from r.
func seedSalt(r *rand.Rand) string {
	const hex = "0123456789abcdef"
	b := make([]byte, 256)
	for i := range b {
		b[i] = hex[r.IntN(16)]
	}
	return string(b)
}
