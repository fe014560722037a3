package sim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/kvevents"
)

func TestMain(m *testing.M) {
	// zmq4 v0.17's PUB writer goroutine can miss its close signal (Close
	// signals a sync.Cond that run is not yet waiting on) and then waits
	// forever; it is the library's goroutine, not ours.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// recordingPublisher keeps every batch in memory.
type recordingPublisher struct {
	mu      sync.Mutex
	batches []kvevents.Batch
	closed  int
}

func (p *recordingPublisher) Publish(b kvevents.Batch) (kvevents.Seq, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.batches = append(p.batches, b)
	return kvevents.Seq(len(p.batches) - 1), nil
}

func (p *recordingPublisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed++
	return nil
}

func (p *recordingPublisher) events() []kvevents.Event {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []kvevents.Event
	for _, b := range p.batches {
		out = append(out, b.Events...)
	}
	return out
}

func startServer(t *testing.T, mod func(*Config)) (*Server, *recordingPublisher) {
	t.Helper()
	cfg := LocalConfig()
	pub := &recordingPublisher{}
	cfg.Publisher = pub
	cfg.Logger = slog.New(slog.DiscardHandler)
	if mod != nil {
		mod(&cfg)
	}
	s, err := NewServer(cfg)
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, s.Shutdown(ctx))
		require.NoError(t, s.Shutdown(ctx), "Shutdown is idempotent")
	})
	return s, pub
}

func post(t *testing.T, url, body string) *http.Response {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	require.NoError(t, err)
	return resp
}

// readSSE returns the data payloads of an SSE body and checks the framing.
func readSSE(t *testing.T, r io.Reader) []string {
	t.Helper()
	raw, err := io.ReadAll(r)
	require.NoError(t, err)
	var out []string
	for _, ev := range strings.SplitAfter(string(raw), "\n\n") {
		if ev == "" {
			continue
		}
		require.True(t, strings.HasPrefix(ev, "data: ") && strings.HasSuffix(ev, "\n\n") && strings.Count(ev, "\n") == 2, "bad SSE frame %q", ev)
		out = append(out, strings.TrimSuffix(strings.TrimPrefix(ev, "data: "), "\n\n"))
	}
	return out
}

type chunk struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index int     `json:"index"`
		Text  *string `json:"text"`
		Delta *struct {
			Role    string  `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
		Message *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		TotalTokens         int `json:"total_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

func TestCompletionsStreamFramingAndPrefixHit(t *testing.T) {
	s, pub := startServer(t, nil)
	prompt := strings.Repeat("abcdefgh", 20) // 160 bytes = 10 blocks
	body := fmt.Sprintf(`{"model":"sim-model","prompt":%q,"max_tokens":5,"temperature":0,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, prompt)
	var cached []int
	for range 2 {
		resp := post(t, s.URL()+"/v1/completions", body)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.True(t, strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream"))
		frames := readSSE(t, resp.Body)
		resp.Body.Close()
		require.Len(t, frames, 5+1+1, "5 content chunks, a usage chunk, [DONE]")
		require.Equal(t, "[DONE]", frames[len(frames)-1])
		var text strings.Builder
		var id string
		for i, f := range frames[:5] {
			var c chunk
			require.NoError(t, json.Unmarshal([]byte(f), &c))
			require.Equal(t, "text_completion", c.Object)
			require.Equal(t, "sim-model", c.Model)
			require.Nil(t, c.Usage)
			require.Len(t, c.Choices, 1)
			require.NotNil(t, c.Choices[0].Text)
			require.Equal(t, OutputTokenText(i), *c.Choices[0].Text)
			text.WriteString(*c.Choices[0].Text)
			if i == 4 {
				require.Equal(t, "length", *c.Choices[0].FinishReason)
			} else {
				require.Nil(t, c.Choices[0].FinishReason)
			}
			if id == "" {
				id = c.ID
			}
			require.Equal(t, id, c.ID)
		}
		var u chunk
		require.NoError(t, json.Unmarshal([]byte(frames[5]), &u))
		require.Contains(t, frames[5], `"choices":[]`)
		require.NotNil(t, u.Usage)
		require.Equal(t, 160, u.Usage.PromptTokens)
		require.Equal(t, 5, u.Usage.CompletionTokens)
		require.Equal(t, 165, u.Usage.TotalTokens)
		cached = append(cached, u.Usage.PromptTokensDetails.CachedTokens)
	}
	require.Equal(t, []int{0, 144}, cached, "second request hits 9 of 10 blocks (the last token is recomputed)")
	st := s.Stats()
	require.Equal(t, uint64(320), st.PrefixQueries)
	require.Equal(t, uint64(144), st.PrefixHits)

	// The metrics say the same.
	m := scrape(t, s)
	require.Contains(t, m, `vllm:prefix_cache_queries_total{model_name="sim-model"} 320`)
	require.Contains(t, m, `vllm:prefix_cache_hits_total{model_name="sim-model"} 144`)
	require.Contains(t, m, `vllm:request_success_total{finished_reason="length",model_name="sim-model"} 2`)
	require.Contains(t, m, `vllm:time_to_first_token_seconds_count{model_name="sim-model"} 2`)
	require.Contains(t, m, `vllm:num_requests_running{model_name="sim-model"} 0`)
	require.Contains(t, m, `vllm:num_requests_waiting{model_name="sim-model"} 0`)
	require.Contains(t, m, `vllm:kv_cache_usage_perc{model_name="sim-model"} 0`)
	require.Contains(t, m, `vllm:generation_tokens_total{model_name="sim-model"} 10`)

	// Events: the first request stored the 10 prompt blocks (its 4
	// computed output tokens fill no further block); the second request
	// recomputes block 10 but it is already cached, so nothing new.
	var stored []kvevents.EngineHash
	for _, ev := range pub.events() {
		require.Equal(t, kvevents.KindBlockStored, ev.Kind)
		stored = append(stored, ev.Stored.BlockHashes...)
	}
	require.Equal(t, s.HashTokens(s.Tokenize(prompt)), stored)
	first := pub.events()[0].Stored
	require.False(t, first.HasParent)
	require.Equal(t, 16, first.BlockSize)
	require.Equal(t, MediumGPU, first.Medium)
	require.Equal(t, s.Tokenize(prompt), first.TokenIDs[:160])
}

func scrape(t *testing.T, s *Server) string {
	t.Helper()
	resp, err := http.Get(s.URL() + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

func TestCompletionsNonStreamAndTokenPrompt(t *testing.T) {
	s, _ := startServer(t, nil)
	resp := post(t, s.URL()+"/v1/completions", `{"model":"sim-model","prompt":[1,2,3,4,5],"max_tokens":3}`)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var c chunk
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&c))
	require.Equal(t, "text_completion", c.Object)
	require.True(t, strings.HasPrefix(c.ID, "cmpl-"))
	require.Equal(t, OutputTokenText(0)+OutputTokenText(1)+OutputTokenText(2), *c.Choices[0].Text)
	require.Equal(t, "length", *c.Choices[0].FinishReason)
	require.Equal(t, 5, c.Usage.PromptTokens)
	require.Equal(t, 3, c.Usage.CompletionTokens)
}

func TestChatStreamAndNonStream(t *testing.T) {
	s, _ := startServer(t, nil)
	body := `{"model":"sim-model","messages":[{"role":"user","content":"hello there"}],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`
	resp := post(t, s.URL()+"/v1/chat/completions", body)
	frames := readSSE(t, resp.Body)
	resp.Body.Close()
	require.Len(t, frames, 1+3+1+1, "role chunk, 3 content chunks, usage, [DONE]")
	var role chunk
	require.NoError(t, json.Unmarshal([]byte(frames[0]), &role))
	require.Equal(t, "chat.completion.chunk", role.Object)
	require.Equal(t, "assistant", role.Choices[0].Delta.Role)
	for i := range 3 {
		var c chunk
		require.NoError(t, json.Unmarshal([]byte(frames[1+i]), &c))
		require.Equal(t, OutputTokenText(i), *c.Choices[0].Delta.Content)
	}
	var u chunk
	require.NoError(t, json.Unmarshal([]byte(frames[4]), &u))
	require.Empty(t, u.Choices)
	require.Equal(t, 3, u.Usage.CompletionTokens)
	tokResp := post(t, s.URL()+"/tokenize", `{"model":"sim-model","messages":[{"role":"user","content":"hello there"}]}`)
	var tk tokenizeResponse
	require.NoError(t, json.NewDecoder(tokResp.Body).Decode(&tk))
	tokResp.Body.Close()
	require.Equal(t, tk.Count, u.Usage.PromptTokens, "/tokenize and the engine agree on the chat prompt")
	require.Equal(t, 4096, tk.MaxModelLen)

	resp = post(t, s.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}`)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var c chunk
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&c))
	require.Equal(t, "chat.completion", c.Object)
	require.Equal(t, "assistant", c.Choices[0].Message.Role)
	require.Equal(t, OutputTokenText(0)+OutputTokenText(1), c.Choices[0].Message.Content)
}

func TestBadInput(t *testing.T) {
	s, _ := startServer(t, func(c *Config) { c.MaxModelLen = 100 })
	cases := []struct {
		name, path, body string
		status           int
	}{
		{"malformed json", "/v1/completions", `{"prompt":`, 400},
		{"missing prompt", "/v1/completions", `{"model":"sim-model","max_tokens":3}`, 400},
		{"empty prompt", "/v1/completions", `{"prompt":"","max_tokens":3}`, 400},
		{"prompt wrong type", "/v1/completions", `{"prompt":{"a":1},"max_tokens":3}`, 400},
		{"mixed prompt list", "/v1/completions", `{"prompt":["a",[1]],"max_tokens":3}`, 400},
		{"prompt over max model len", "/v1/completions", fmt.Sprintf(`{"prompt":%q,"max_tokens":1}`, strings.Repeat("x", 100)), 400},
		{"max_tokens zero", "/v1/completions", `{"prompt":"hi","max_tokens":0}`, 400},
		{"max_tokens negative", "/v1/completions", `{"prompt":"hi","max_tokens":-5}`, 400},
		{"max_tokens too large", "/v1/completions", `{"prompt":"hi","max_tokens":99}`, 400},
		{"max_tokens not a number", "/v1/completions", `{"prompt":"hi","max_tokens":"x"}`, 400},
		{"stream_options without stream", "/v1/completions", `{"prompt":"hi","max_tokens":1,"stream_options":{"include_usage":true}}`, 400},
		{"n > 1", "/v1/completions", `{"prompt":"hi","max_tokens":1,"n":2}`, 400},
		{"negative temperature", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":1,"temperature":-1}`, 400},
		{"unknown model", "/v1/completions", `{"model":"gpt-5","prompt":"hi","max_tokens":1}`, 404},
		{"unknown model chat", "/v1/chat/completions", `{"model":"gpt-5","messages":[{"role":"user","content":"x"}]}`, 404},
		{"missing messages", "/v1/chat/completions", `{"max_tokens":1}`, 400},
		{"bad messages", "/v1/chat/completions", `{"messages":"hi","max_tokens":1}`, 400},
		{"tokenize missing prompt", "/tokenize", `{}`, 400},
		{"tokenize unknown model", "/tokenize", `{"model":"x","prompt":"a"}`, 404},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, s.URL()+tc.path, tc.body)
			defer resp.Body.Close()
			require.Equal(t, tc.status, resp.StatusCode)
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&e))
			require.NotEmpty(t, e.Error.Message)
			require.NotEmpty(t, e.Error.Type)
			require.Equal(t, tc.status, e.Error.Code)
		})
	}
	// The server still works.
	resp := post(t, s.URL()+"/v1/completions", `{"prompt":"hi","max_tokens":1}`)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	// Default max_tokens = rest of context.
	resp = post(t, s.URL()+"/v1/completions", fmt.Sprintf(`{"prompt":%q}`, strings.Repeat("x", 95)))
	var c chunk
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&c))
	resp.Body.Close()
	require.Equal(t, 5, c.Usage.CompletionTokens)
}

func TestModelsHealth(t *testing.T) {
	s, _ := startServer(t, nil)
	resp, err := http.Get(s.URL() + "/health")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	resp, err = http.Get(s.URL() + "/v1/models")
	require.NoError(t, err)
	var m struct {
		Object string `json:"object"`
		Data   []struct {
			ID          string `json:"id"`
			Object      string `json:"object"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&m))
	resp.Body.Close()
	require.Equal(t, "list", m.Object)
	require.Len(t, m.Data, 1)
	require.Equal(t, "sim-model", m.Data[0].ID)
	require.Equal(t, 4096, m.Data[0].MaxModelLen)
}

// slowFast is a profile slow enough that a test can act mid-stream.
var slowFast = Profile{Name: "slow", StepOverhead: time.Millisecond, WeightRead: 2 * time.Millisecond, PrefillPerToken: time.Microsecond, DecodePerSeq: 0}

func TestClientDisconnectFreesSequenceAndBlocks(t *testing.T) {
	s, _ := startServer(t, func(c *Config) { c.Profile = slowFast })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	body := fmt.Sprintf(`{"prompt":%q,"max_tokens":3000,"stream":true}`, strings.Repeat("z", 200))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.URL()+"/v1/completions", strings.NewReader(body))
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(line, "data: "))
	st := s.Stats()
	require.Equal(t, 1, st.Running)
	require.Positive(t, st.KVUsage)
	cancel()
	resp.Body.Close()
	require.Eventually(t, func() bool {
		st := s.Stats()
		return st.Running == 0 && st.Waiting == 0 && st.KVUsage == 0
	}, 5*time.Second, 5*time.Millisecond)
	require.Eventually(t, func() bool {
		return strings.Contains(scrape(t, s), `vllm:request_aborted_total{model_name="sim-model"} 1`)
	}, 5*time.Second, 5*time.Millisecond)
	// Its full blocks stay cached for reuse.
	require.NotEmpty(t, s.CachedBlocks())
}

func TestResetEndpoint(t *testing.T) {
	s, pub := startServer(t, nil)
	resp := post(t, s.URL()+"/v1/completions", `{"prompt":"0123456789abcdefghijklmnopqrstuvwxyz","max_tokens":2}`)
	resp.Body.Close()
	require.NotEmpty(t, s.CachedBlocks())
	resp = post(t, s.URL()+"/reset_prefix_cache", ``)
	var r map[string]bool
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&r))
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.True(t, r["success"])
	require.Empty(t, s.CachedBlocks())
	evs := pub.events()
	require.Equal(t, kvevents.KindAllBlocksCleared, evs[len(evs)-1].Kind)

	s2, _ := startServer(t, func(c *Config) { c.EnableResetEndpoint = false })
	resp = post(t, s2.URL()+"/reset_prefix_cache", ``)
	resp.Body.Close()
	require.Equal(t, http.StatusNotFound, resp.StatusCode)
}

// TestConcurrentLoad runs a bounded burst through the HTTP API and checks
// the scheduler never exceeds max-num-seqs and the events mirror the cache.
func TestConcurrentLoad(t *testing.T) {
	// Requests start with 3 blocks and grow to 15 while decoding: any two
	// running together overflow 20 blocks, so the scheduler must preempt,
	// and every stream must still complete, in order.
	s, pub := startServer(t, func(c *Config) { c.NumGPUBlocks, c.Speed = 20, 100 })
	var wg sync.WaitGroup
	errs := make(chan error, 24)
	for i := range 24 {
		wg.Go(func() {
			body := fmt.Sprintf(`{"prompt":%q,"max_tokens":200,"stream":true,"stream_options":{"include_usage":true}}`,
				strings.Repeat(fmt.Sprint(i%3), 36)+fmt.Sprint(i))
			resp, err := http.Post(s.URL()+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			raw, _ := io.ReadAll(resp.Body)
			if !strings.HasSuffix(string(raw), "data: [DONE]\n\n") {
				errs <- fmt.Errorf("request %d: stream did not end with [DONE]: %d %q", i, resp.StatusCode, raw)
				return
			}
			var text strings.Builder
			for _, f := range strings.Split(string(raw), "\n\n") {
				var c chunk
				if json.Unmarshal([]byte(strings.TrimPrefix(f, "data: ")), &c) == nil && len(c.Choices) == 1 {
					text.WriteString(*c.Choices[0].Text)
				}
			}
			var want strings.Builder
			for k := range 200 {
				want.WriteString(OutputTokenText(k))
			}
			if text.String() != want.String() {
				errs <- fmt.Errorf("request %d: text %q, want %q", i, text.String(), want.String())
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	st := s.Stats()
	require.Equal(t, uint64(24), st.Finished[FinishLength])
	require.Positive(t, st.Preemptions, "the small pool should force preemption")
	m := mirror{}
	m.apply(t, pub.events())
	m.requireMatches(t, s)
}

// TestSpeedCompressesModelTime runs a seed-sized cold prefill on the l20
// profile at speed 50: it takes tens of wall milliseconds, while the TTFT
// metric reports model seconds.
func TestSpeedCompressesModelTime(t *testing.T) {
	s, _ := startServer(t, func(c *Config) {
		c.Profile = ProfileL20Qwen27BFP8
		c.Speed = 50
		c.MaxModelLen = 8192
		c.MaxNumBatchedTokens = 8192
	})
	start := time.Now()
	resp := post(t, s.URL()+"/v1/completions", fmt.Sprintf(`{"prompt":%q,"max_tokens":2}`, strings.Repeat("y", 5000)))
	resp.Body.Close()
	wall := time.Since(start)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var sum float64
	for _, line := range strings.Split(scrape(t, s), "\n") {
		if strings.HasPrefix(line, "vllm:time_to_first_token_seconds_sum") {
			_, err := fmt.Sscanf(line[strings.LastIndexByte(line, ' ')+1:], "%g", &sum)
			require.NoError(t, err)
		}
	}
	// 5000 tokens × 0.32 ms + 6 ms = 1.606 s of model time.
	require.InDelta(t, 1.606, sum, 0.8, "TTFT in model seconds")
	require.Less(t, wall, 2*time.Second, "speed 50 runs ~32 ms of wall time")
	t.Logf("model TTFT %.3fs, wall %v", sum, wall)
}

// TestHoldStreams: a held stream sends its first content chunk and then
// nothing until release, though the engine has generated every token; a
// stream shorter than the hold's minimum is not held; after release the
// held stream ends complete.
func TestHoldStreams(t *testing.T) {
	s, _ := startServer(t, nil)
	release := s.HoldStreams(10)
	defer release()

	long := post(t, s.URL()+"/v1/completions", `{"prompt":"held","max_tokens":20,"stream":true}`)
	defer long.Body.Close()
	br := bufio.NewReader(long.Body)
	first, err := br.ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(first, "data: "), "the first chunk comes before the hold")
	blank, err := br.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "\n", blank)
	rest := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(br) // parsed on the test's goroutine
		rest <- b
	}()

	short := post(t, s.URL()+"/v1/completions", `{"prompt":"not held","max_tokens":5,"stream":true}`)
	events := readSSE(t, short.Body)
	short.Body.Close()
	require.Equal(t, "[DONE]", events[len(events)-1], "a stream shorter than the minimum is not held")
	require.Eventually(t, func() bool {
		st := s.Stats()
		return st.Running == 0 && st.Waiting == 0
	}, 10*time.Second, 5*time.Millisecond, "the engine generates the held stream's tokens meanwhile")
	select {
	case b := <-rest:
		t.Fatalf("the held stream ended before release: %q", b)
	default:
	}

	release()
	var got []string
	select {
	case b := <-rest:
		got = readSSE(t, bytes.NewReader(b))
	case <-time.After(10 * time.Second):
		t.Fatal("the held stream did not end after release")
	}
	require.Len(t, got, 20, "19 more content chunks and [DONE]")
	require.Equal(t, "[DONE]", got[len(got)-1])
	release() // idempotent
}
