package admintest

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestCallResendsWritesAnswered503(t *testing.T) {
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		assert.Equal(t, "Bearer tok", r.Header.Get("Authorization"))
		b, _ := io.ReadAll(r.Body)
		assert.Equal(t, `{"a":1}`, string(b), "every attempt carries the whole body")
		if calls.Add(1) < 3 {
			http.Error(w, `{"error":{"code":"no_quorum"}}`, http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte(`{"version":7}`))
	}))
	defer srv.Close()

	code, out, retried := Call(t, http.MethodPatch, srv.URL, "tok", `{"a":1}`)
	assert.Equal(t, http.StatusOK, code)
	assert.Equal(t, `{"version":7}`, string(out))
	assert.True(t, retried)
	assert.EqualValues(t, 3, calls.Load())

	calls.Store(0)
	code, _, retried = Call(t, http.MethodGet, srv.URL, "tok", `{"a":1}`)
	assert.Equal(t, http.StatusServiceUnavailable, code, "a read is not resent")
	assert.False(t, retried)
	assert.EqualValues(t, 1, calls.Load())
}
