package sim

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func postJSON(t *testing.T, s *Server, path, body string) (int, []byte) {
	t.Helper()
	resp, err := http.Post(s.URL()+path, "application/json", strings.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, b
}

// A prompt list is one request with one choice per prompt, as vLLM serves it.
func TestBatchCompletions(t *testing.T) {
	s, _ := startServer(t, nil)
	code, b := postJSON(t, s, "/v1/completions", `{"prompt":["a b c","d e"],"max_tokens":2}`)
	require.Equal(t, http.StatusOK, code, string(b))
	var r struct {
		Choices []struct {
			Index int    `json:"index"`
			Text  string `json:"text"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	require.NoError(t, json.Unmarshal(b, &r))
	require.Len(t, r.Choices, 2)
	assert.Equal(t, 1, r.Choices[1].Index)
	assert.Equal(t, 4, r.Usage.CompletionTokens)
}

// Embeddings are deterministic unit vectors; base64 is the float32 bytes.
func TestEmbeddingsDeterministic(t *testing.T) {
	s, _ := startServer(t, nil)
	vec := func(body string) []float32 {
		code, b := postJSON(t, s, "/v1/embeddings", body)
		require.Equal(t, http.StatusOK, code, string(b))
		var r struct {
			Data []struct {
				Embedding json.RawMessage `json:"embedding"`
			} `json:"data"`
		}
		require.NoError(t, json.Unmarshal(b, &r))
		var v []float32
		if json.Unmarshal(r.Data[0].Embedding, &v) == nil {
			return v
		}
		var s64 string
		require.NoError(t, json.Unmarshal(r.Data[0].Embedding, &s64))
		raw, err := base64.StdEncoding.DecodeString(s64)
		require.NoError(t, err)
		v = make([]float32, len(raw)/4)
		for i := range v {
			v[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
		}
		return v
	}
	a := vec(`{"input":"hello"}`)
	assert.Equal(t, a, vec(`{"input":"hello","encoding_format":"base64"}`))
	assert.NotEqual(t, a, vec(`{"input":"world"}`))
	var norm float64
	for _, x := range a {
		norm += float64(x) * float64(x)
	}
	assert.InDelta(t, 1, norm, 1e-5)
}

// The Responses store: create, follow up, retrieve, delete.
func TestResponsesStore(t *testing.T) {
	s, _ := startServer(t, nil)
	code, b := postJSON(t, s, "/v1/responses", `{"input":"hi","instructions":"be brief","max_output_tokens":3}`)
	require.Equal(t, http.StatusOK, code, string(b))
	var r struct {
		ID     string `json:"id"`
		Status string `json:"status"`
		Usage  struct {
			InputTokens int `json:"input_tokens"`
		} `json:"usage"`
	}
	require.NoError(t, json.Unmarshal(b, &r))
	assert.Equal(t, "completed", r.Status)
	first := r.Usage.InputTokens
	code, b = postJSON(t, s, "/v1/responses", `{"input":"more","previous_response_id":"`+r.ID+`","max_output_tokens":3}`)
	require.Equal(t, http.StatusOK, code, string(b))
	var r2 struct {
		Usage struct {
			InputTokens int `json:"input_tokens"`
		} `json:"usage"`
	}
	require.NoError(t, json.Unmarshal(b, &r2))
	assert.Greater(t, r2.Usage.InputTokens, first-len("be brief"), "the follow-up carries the stored conversation")
	code, _ = postJSON(t, s, "/v1/responses", `{"input":"x","previous_response_id":"resp_nope"}`)
	assert.Equal(t, http.StatusNotFound, code)
	assert.Equal(t, 2, s.StoredResponses())
	req, _ := http.NewRequest(http.MethodDelete, s.URL()+"/v1/responses/"+r.ID, nil)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	resp, err = http.Get(s.URL() + "/v1/responses/" + r.ID)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)

	code, b = postJSON(t, s, "/v1/responses", `{"input":"hi","stream":true,"max_output_tokens":2}`)
	require.Equal(t, http.StatusOK, code)
	events := strings.Count(string(b), "event: ")
	assert.Equal(t, 10, events, string(b)) // created, in_progress, item added, part added, 2 deltas, text done, part done, item done, completed
	assert.True(t, strings.HasPrefix(string(b), "event: response.created\n"))
	assert.Contains(t, string(b), "event: response.completed\n")
}
