package config

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
)

// TestRaftLogDemotesGonePeers drives raft's real logger (hclog, JSON) into
// slogWriter: a replication error about a peer gossip still lists stays an
// ERROR, the same error about a peer that left is INFO with peer_left, the
// fields become attributes once each, and other errors are untouched.
func TestRaftLogDemotesGonePeers(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	members := NewStaticMembership(Member{ID: "a", RaftAddr: "127.0.0.1:7001"}, Member{ID: "b", RaftAddr: "127.0.0.1:7002"})
	h := hclog.New(&hclog.LoggerOptions{Name: "raft", Level: hclog.Debug, JSONFormat: true,
		Output: slogWriter{log: log, gone: peerGone(members)}})

	h.Error("failed to heartbeat to", "peer", "127.0.0.1:7002", "backoff time", "10ms", "error", "connection refused")
	h.Error("failed to heartbeat to", "peer", "127.0.0.1:7003", "backoff time", "10ms", "error", "connection refused")
	type server struct{ ID, Address string }
	h.Error("failed to appendEntries to", "peer", server{ID: "c", Address: "127.0.0.1:7003"}, "error", "EOF")
	h.Error("failed to commit logs", "error", "disk full")
	h.Warn("heartbeat timeout reached, starting election", "last-leader-addr", "127.0.0.1:7001")

	var recs []map[string]any
	for line := range strings.Lines(buf.String()) {
		var r map[string]any
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		recs = append(recs, r)
	}
	if len(recs) != 5 {
		t.Fatalf("%d records, want 5:\n%s", len(recs), buf.String())
	}
	want := []struct {
		level, msg string
		left       bool
	}{
		{"ERROR", "raft: failed to heartbeat to", false},
		{"INFO", "raft: failed to heartbeat to", true},
		{"INFO", "raft: failed to appendEntries to", true},
		{"ERROR", "raft: failed to commit logs", false},
		{"WARN", "raft: heartbeat timeout reached, starting election", false},
	}
	for i, w := range want {
		r := recs[i]
		if r["level"] != w.level || r["msg"] != w.msg || (r["peer_left"] == true) != w.left {
			t.Errorf("record %d = %v, want level %s msg %q peer_left %v", i, r, w.level, w.msg, w.left)
		}
	}
	if recs[0]["backoff_time"] != "10ms" || recs[0]["error"] != "connection refused" || recs[0]["peer"] != "127.0.0.1:7002" {
		t.Errorf("fields not carried as attributes: %v", recs[0])
	}
	if p, _ := recs[2]["peer"].(string); !strings.Contains(p, "Address=127.0.0.1:7003") {
		t.Errorf("a server peer is not flattened: %v", recs[2]["peer"])
	}
}
