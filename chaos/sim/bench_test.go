package sim

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"
)

// BenchmarkEngineStep measures one engine step of a full decode batch
// (8 sequences, block 16) with prefix caching and events on, including the
// admission of a new seed-sized request whenever one finishes.
func BenchmarkEngineStep(b *testing.B) {
	cfg := EngineConfig{
		MaxModelLen: 32768, MaxNumSeqs: 8, MaxNumBatchedTokens: 8192,
		BlockSize: 16, NumBlocks: 12_500, Profile: ProfileL20Qwen27BFP8, HashSeed: 1, EmitEvents: true,
	}
	e, err := NewEngine(cfg)
	if err != nil {
		b.Fatal(err)
	}
	now := time.Unix(0, 0)
	n := 0
	add := func() {
		p := seedTokens(n)
		p[0] = uint32(n % 8) // 8 prefix groups
		if err := e.Add(Request{ID: RequestID(fmt.Sprint(n)), Prompt: p, MaxTokens: 128}, now); err != nil {
			b.Fatal(err)
		}
		n++
	}
	for range 16 {
		add()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		r := e.Step(now)
		now = r.End()
		for range r.Finished {
			add()
		}
	}
}

// BenchmarkEngineAdmit measures admitting a seed-sized request whose
// ~5,000-token prefix is cached (the prefix lookup walks ~315 blocks),
// through its one-token completion, in a batch of up to 8.
func BenchmarkEngineAdmit(b *testing.B) {
	cfg := EngineConfig{
		MaxModelLen: 32768, MaxNumSeqs: 8, MaxNumBatchedTokens: 8192,
		BlockSize: 16, NumBlocks: 12_500, Profile: ProfileL20Qwen27BFP8, HashSeed: 1, EmitEvents: true,
	}
	e, err := NewEngine(cfg)
	if err != nil {
		b.Fatal(err)
	}
	now := time.Unix(0, 0)
	n := 0
	b.ReportAllocs()
	for b.Loop() {
		if err := e.Add(Request{ID: RequestID(fmt.Sprint(n)), Prompt: seedTokens(n), MaxTokens: 1}, now); err != nil {
			b.Fatal(err)
		}
		n++
		if n%8 == 0 {
			for r := e.Step(now); !r.Idle(); r = e.Step(now) {
				now = r.End()
			}
		}
	}
}

// FuzzParseRequest feeds arbitrary bodies through request decoding and
// validation: never a panic, and every accepted prompt is checkable.
func FuzzParseRequest(f *testing.F) {
	s, err := NewServer(LocalConfig())
	if err != nil {
		f.Fatal(err)
	}
	for _, seed := range []string{
		`{"prompt":"hi","max_tokens":3}`, `{"prompt":[1,2,3]}`, `{"prompt":[[1,2]]}`, `{"prompt":["a"]}`,
		`{"messages":[{"role":"user","content":"x"}]}`, `{"prompt":null}`, `{"max_tokens":-1,"prompt":"x"}`,
		`{"prompt":[4294967296]}`, `{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var p genParams
		if err := jsonUnmarshal(body, &p); err != nil {
			return
		}
		for _, parse := range []func() ([]uint32, error){
			func() ([]uint32, error) { return s.parsePrompt(p.Prompt) },
			func() ([]uint32, error) { return s.parseMessages(p.Messages) },
		} {
			toks, err := parse()
			if err != nil {
				if errorStatus(err) != 400 {
					t.Fatalf("parse error maps to %d: %v", errorStatus(err), err)
				}
				continue
			}
			if mt, err := s.maxTokens(&p, len(toks)); err == nil {
				_ = s.eng.Check(len(toks), mt)
			}
		}
	})
}

var jsonUnmarshal = json.Unmarshal
