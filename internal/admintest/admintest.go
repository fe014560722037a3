// Package admintest sends admin API calls for tests and rides out the raft
// elections of a young or loaded cluster: a config write answered 503 (no
// leader yet, or a leader that lost its lease mid-write) is sent again.
// Imported by tests only.
package admintest

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// Patience is how long Call keeps resending a write answered 503.
const Patience = 15 * time.Second

// Call sends method to url with the bearer token and body (JSON). A write
// (any method but GET) answered 503 is sent again every 50ms until it gets
// another answer or Patience runs out; the writes tests make only set
// values, so a resend that lands twice changes nothing. It returns the
// last answer's status and body, and whether it resent.
func Call(t testing.TB, method, url, token, body string) (code int, out []byte, retried bool) {
	t.Helper()
	deadline := time.Now().Add(Patience)
	for {
		req, err := http.NewRequest(method, url, strings.NewReader(body))
		if err != nil {
			t.Fatalf("admintest: %v", err)
		}
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("admintest: %s %s: %v", method, url, err)
		}
		out, err = io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatalf("admintest: %s %s: reading the answer: %v", method, url, err)
		}
		if method == http.MethodGet || resp.StatusCode != http.StatusServiceUnavailable || time.Now().After(deadline) {
			return resp.StatusCode, out, retried
		}
		retried = true
		time.Sleep(50 * time.Millisecond) // polling for a raft leader, with a deadline
	}
}
