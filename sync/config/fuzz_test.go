package config

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/hashicorp/raft"
)

// FuzzParseDocument: any body a client sends either fails with
// ErrInvalidConfig or yields a valid document that round-trips.
func FuzzParseDocument(f *testing.F) {
	good := testConfig()
	doc, _ := json.Marshal(&good)
	f.Add(doc)
	f.Add([]byte(`{"models":{"m":{"replicas":[{"name":"a","url":"http://h:1"}]}},"index":{"history_ttl":"1s"}}`))
	f.Add([]byte(`{"hash_seed":18446744073709551615}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseDocument(data)
		if err != nil {
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("error does not wrap ErrInvalidConfig: %v", err)
			}
			return
		}
		again, err := json.Marshal(&c)
		if err != nil {
			t.Fatal(err)
		}
		c2, err := ParseDocument(again)
		if err != nil {
			t.Fatalf("a valid document does not re-parse: %v", err)
		}
		if c2.HashSeed != c.HashSeed || len(c2.Models) != len(c.Models) {
			t.Fatal("round trip changed the document")
		}
	})
}

// FuzzFSMApply: arbitrary log entries never panic the FSM, and the config
// it publishes is always valid.
func FuzzFSMApply(f *testing.F) {
	set, _ := encodeCommand(SetCommand(testConfig(), nil))
	patch, _ := encodeCommand(PatchCommand([]byte(`{"strategy":"cost"}`), nil))
	add, _ := encodeCommand(AddReplicaCommand("chat", ReplicaConfig{Name: "z", URL: "http://h:3"}))
	f.Add(set, patch)
	f.Add(patch, add)
	f.Add([]byte{1, '{', '}'}, []byte{})
	f.Fuzz(func(t *testing.T, a, b []byte) {
		m, err := newMetrics(nil)
		if err != nil {
			t.Fatal(err)
		}
		fsm := newFSM(m, discard(), nil)
		for i, d := range [][]byte{set, a, b} {
			fsm.Apply(&raft.Log{Index: uint64(i + 1), Type: raft.LogCommand, Data: d})
			if c := fsm.Current().Config; c != nil {
				if err := c.Validate(); err != nil {
					t.Fatalf("published an invalid config: %v", err)
				}
			}
		}
	})
}

func FuzzMergePatch(f *testing.F) {
	f.Add([]byte(`{"a":{"b":1}}`), []byte(`{"a":{"b":null,"c":[1]}}`))
	f.Fuzz(func(t *testing.T, doc, patch []byte) {
		out, err := MergePatch(doc, patch)
		if err != nil {
			return
		}
		// Applying the same patch twice changes nothing more (RFC 7386
		// patches are idempotent).
		again, err := MergePatch(out, patch)
		if err != nil {
			t.Fatalf("re-applying failed: %v", err)
		}
		if !jsonEqualBytes(out, again) {
			t.Fatalf("not idempotent: %s vs %s", out, again)
		}
	})
}

func jsonEqualBytes(a, b []byte) bool {
	var x, y any
	if decodeNumbers(a, &x) != nil || decodeNumbers(b, &y) != nil {
		return false
	}
	return jsonEqual(x, y)
}

func BenchmarkCurrent(b *testing.B) {
	m, _ := newMetrics(nil)
	fsm := newFSM(m, discard(), nil)
	data, _ := encodeCommand(SetCommand(testConfig(), nil))
	fsm.Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: data})
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if fsm.Current().Config == nil {
				b.Fatal("no config")
			}
		}
	})
}
