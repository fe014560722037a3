package index

import (
	"bytes"
	"errors"
	"reflect"
	"testing"
)

func sampleKVEvents() []KVEvent {
	return []KVEvent{
		{Kind: KVStored, Stored: StoredBlocks{Hashes: []uint64{10, 11}, ParentHash: 9, HasParent: true,
			Root: 77, HasRoot: true, BlockTokens: 2, Tokens: []uint32{1, 2, 3, 1<<32 - 1}}},
		{Kind: KVStored, Stored: StoredBlocks{Hashes: []uint64{12}, BlockTokens: 1, Tokens: []uint32{5}}},
		{Kind: KVRemoved, Removed: []uint64{10}},
		{Kind: KVCleared},
		{Kind: KVStored, Stored: StoredBlocks{Hashes: []uint64{13}, BlockTokens: 1, Tokens: []uint32{6},
			Group: 1, GroupKind: GroupSliding, Window: 4096}},
		{Kind: KVStored, Stored: StoredBlocks{Hashes: []uint64{13}, BlockTokens: 1, Tokens: []uint32{6}, GroupKind: GroupSliding}},
		{Kind: KVRemoved, Removed: []uint64{13}, Group: 2},
		{Kind: KVStored, Stored: StoredBlocks{Hashes: []uint64{14}, BlockTokens: 1, Tokens: []uint32{7}, Tier: TierCPU}},
		{Kind: KVRemoved, Removed: []uint64{14}, Tier: TierDisk},
		{Kind: KVRemoved, Removed: []uint64{14}, Group: 1, Tier: TierCPU},
	}
}

func TestKVEventCodecRoundTrip(t *testing.T) {
	for _, ev := range sampleKVEvents() {
		b, err := AppendKVEvent([]byte{0xAA}, &ev)
		if err != nil {
			t.Fatal(err)
		}
		var got KVEvent
		rest, err := ReadKVEvent(append(bytes.Clone(b[1:]), 0xBB), &got)
		if err != nil {
			t.Fatalf("%v: %v", ev.Kind, err)
		}
		if !bytes.Equal(rest, []byte{0xBB}) {
			t.Fatalf("%v: rest %x", ev.Kind, rest)
		}
		if !reflect.DeepEqual(norm(got), norm(ev)) {
			t.Fatalf("%v: got %+v, want %+v", ev.Kind, got, ev)
		}
		// Every strict prefix is malformed, never a panic.
		for i := range len(b) - 1 {
			if _, err := ReadKVEvent(b[1:1+i], &got); !errors.Is(err, ErrMalformedKVEvent) {
				t.Fatalf("%v: prefix %d: %v", ev.Kind, i, err)
			}
		}
	}
}

// norm makes nil and empty slices compare equal.
func norm(ev KVEvent) KVEvent {
	if len(ev.Removed) == 0 {
		ev.Removed = nil
	}
	if len(ev.Stored.Hashes) == 0 {
		ev.Stored.Hashes = nil
	}
	if len(ev.Stored.Tokens) == 0 {
		ev.Stored.Tokens = nil
	}
	return ev
}

func TestKVEventCodecRejects(t *testing.T) {
	for name, ev := range map[string]KVEvent{
		"tokens":     {Kind: KVStored, Stored: StoredBlocks{Hashes: []uint64{1}, BlockTokens: 2, Tokens: []uint32{1}}},
		"block size": {Kind: KVStored, Stored: StoredBlocks{BlockTokens: 0}},
	} {
		if b, err := AppendKVEvent([]byte{1}, &ev); !errors.Is(err, ErrMalformedStored) || len(b) != 1 {
			t.Fatalf("%s: %v, %x", name, err, b)
		}
	}
	if _, err := AppendKVEvent(nil, &KVEvent{Kind: 9}); !errors.Is(err, ErrMalformedKVEvent) {
		t.Fatal(err)
	}
	big := KVEvent{Kind: KVRemoved, Removed: make([]uint64, MaxKVEventHashes+1)}
	if _, err := AppendKVEvent(nil, &big); !errors.Is(err, ErrKVEventTooLarge) {
		t.Fatal(err)
	}
	for name, b := range map[string][]byte{
		"kind":        {9},
		"flags":       {1, 0, 4, 1, 0},
		"block 0":     {1, 0, 0, 0, 0},
		"token count": {1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 1},
		"hash count":  {2, 0xff, 0xff, 0x7f},
		"group 0":     {2 | 0x80, 0, 0},
		"group kind":  {1 | 0x80, 1, 0},
		"empty group": {1, 0, 4, 0, 0, 0, 1, 0},
		"gpu tier":    {2 | 0x40, 0, 0},
		"bad tier":    {1, 0, 8, 3, 1, 0},
	} {
		var ev KVEvent
		if _, err := ReadKVEvent(b, &ev); !errors.Is(err, ErrMalformedKVEvent) {
			t.Fatalf("%s: %v", name, err)
		}
	}
}

// FuzzReadKVEvent: ReadKVEvent never panics, and what it accepts
// re-encodes to the bytes it consumed (one encoding per event).
func FuzzReadKVEvent(f *testing.F) {
	for _, ev := range sampleKVEvents() {
		b, _ := AppendKVEvent(nil, &ev)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var ev KVEvent
		rest, err := ReadKVEvent(b, &ev)
		if err != nil {
			return
		}
		again, err := AppendKVEvent(nil, &ev)
		if err != nil {
			t.Fatalf("accepted %x but cannot re-encode: %v", b, err)
		}
		if !bytes.Equal(again, b[:len(b)-len(rest)]) {
			t.Fatalf("re-encoded %x, consumed %x", again, b[:len(b)-len(rest)])
		}
	})
}

// TestApplyKVMatchesSingleCalls: ApplyKV does what the per-event calls do,
// and its report counts errors, parent-0 starts, removals and clears.
func TestApplyKVMatchesSingleCalls(t *testing.T) {
	a, b := newTestIndex(t, nil), newTestIndex(t, nil)
	h := a.Hasher()
	root := h.Root("m", "", "")
	for _, x := range []*Index{a, b} {
		x.SetReplicaRoot(1, root)
	}
	toks := seqTokens(16, 1)
	evs := []KVEvent{
		{Kind: KVStored, Stored: StoredBlocks{Hashes: []uint64{1, 2}, ParentHash: 0, HasParent: true, BlockTokens: 4, Tokens: toks[:8]}},
		{Kind: KVStored, Stored: StoredBlocks{Hashes: []uint64{3, 4}, ParentHash: 2, HasParent: true, BlockTokens: 4, Tokens: toks[8:]}},
		{Kind: KVStored, Stored: StoredBlocks{Hashes: []uint64{9}, ParentHash: 555, HasParent: true, BlockTokens: 4, Tokens: toks[:4]}},
		{Kind: KVRemoved, Removed: []uint64{4, 77}},
	}
	var rep KVReport
	rep.Errors = append(rep.Errors, errors.New("stale")) // reset by ApplyKV
	a.ApplyKV(1, evs, &rep)
	for _, ev := range evs {
		switch ev.Kind {
		case KVStored:
			_ = b.ApplyStored(1, ev.Stored)
		case KVRemoved:
			b.ApplyRemoved(1, ev.Removed)
		}
	}
	if len(rep.Errors) != 1 || !errors.Is(rep.Errors[0], ErrUnknownParent) || rep.ParentZero != 1 || rep.Removed != 1 || rep.Cleared {
		t.Fatalf("report %+v", rep)
	}
	keys := h.AppendKeys(nil, root, toks)
	for _, x := range []*Index{a, b} {
		if got := x.ConfirmedRun(keys, 1); got != 3 {
			t.Fatalf("confirmed run %d, want 3", got)
		}
	}
	if sa, sb := a.Stats(), b.Stats(); sa.Entries != sb.Entries || sa.ParentZeroStarts != sb.ParentZeroStarts || sa.UnknownRemoved != sb.UnknownRemoved {
		t.Fatalf("stats differ: %+v vs %+v", sa, sb)
	}
	a.ApplyKV(1, []KVEvent{{Kind: KVCleared}}, &rep)
	if !rep.Cleared || rep.Removed != 3 || len(rep.Errors) != 0 || a.ConfirmedRun(keys, 1) != 0 {
		t.Fatalf("after clear: %+v", rep)
	}
	a.ApplyKV(1, evs[:1], nil) // a nil report is fine
	if a.ConfirmedRun(keys, 1) != 2 {
		t.Fatal("nil report: not applied")
	}
}
