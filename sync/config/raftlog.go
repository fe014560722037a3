package config

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sort"
	"strings"
)

// raftPeerErrors are the messages hashicorp/raft v1.8.0 logs at ERROR
// level about one peer it replicates to (replication.go). When that peer
// has left the cluster (gossip no longer lists its raft address) they are
// the expected noise of a graceful leave until the leader removes it from
// the raft configuration: logged at INFO then. TestRaftLogDemotesGonePeers
// pins them.
var raftPeerErrors = map[string]bool{
	"failed to heartbeat to":                  true,
	"failed to appendEntries to":              true,
	"failed to pipeline appendEntries":        true,
	"failed to start pipeline replication to": true,
	"failed to send snapshot to":              true,
}

// slogWriter forwards raft's logger (hclog, JSON format) to slog: one
// record per line with raft's message as the message and its fields as
// attributes, each key once. gone, when set, reports whether the peer a
// line names is no longer a member; raftPeerErrors about such a peer are
// demoted to INFO.
type slogWriter struct {
	log  *slog.Logger
	gone func(peer string) bool
}

func (w slogWriter) Write(p []byte) (int, error) {
	for _, line := range strings.Split(strings.TrimSpace(string(p)), "\n") {
		w.line(line)
	}
	return len(p), nil
}

func (w slogWriter) line(line string) {
	var rec map[string]json.RawMessage
	if err := json.Unmarshal([]byte(line), &rec); err != nil || rec["@message"] == nil {
		w.log.Info("raft", "line", line) // not hclog's JSON: pass it on as is
		return
	}
	var msg, lvl string
	_ = json.Unmarshal(rec["@message"], &msg)
	_ = json.Unmarshal(rec["@level"], &lvl)
	level := slog.LevelInfo
	switch lvl {
	case "error":
		level = slog.LevelError
	case "warn":
		level = slog.LevelWarn
	case "debug", "trace":
		level = slog.LevelDebug
	}
	keys := make([]string, 0, len(rec))
	for k := range rec {
		if !strings.HasPrefix(k, "@") {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	attrs := make([]any, 0, 2*len(keys)+2)
	for _, k := range keys {
		var v any
		if json.Unmarshal(rec[k], &v) != nil {
			v = string(rec[k])
		}
		attrs = append(attrs, strings.ReplaceAll(k, " ", "_"), flatten(v))
	}
	if level == slog.LevelError && raftPeerErrors[msg] && w.gone != nil {
		if peer, ok := rec["peer"]; ok && w.gone(string(peer)) {
			level = slog.LevelInfo
			attrs = append(attrs, "peer_left", true)
		}
	}
	w.log.Log(context.Background(), level, "raft: "+msg, attrs...)
}

// flatten turns a JSON object (raft logs a peer as {Suffrage, ID,
// Address}) into one "k=v k=v" value, so a text log keeps one key per
// field.
func flatten(v any) any {
	m, ok := v.(map[string]any)
	if !ok {
		return v
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%v", k, m[k]))
	}
	return strings.Join(parts, " ")
}

// peerGone reports whether a raft log line's peer field (raw JSON: an
// address string or a server object) names none of the alive members'
// raft addresses.
func peerGone(m Membership) func(string) bool {
	return func(peer string) bool {
		if m == nil {
			return false
		}
		for _, mem := range m.Members() {
			if mem.RaftAddr != "" && strings.Contains(peer, mem.RaftAddr) {
				return false
			}
		}
		return true
	}
}
