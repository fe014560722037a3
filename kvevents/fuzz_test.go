package kvevents

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// FuzzDecode checks that no input makes the decoder panic or return a batch
// that is neither an error nor a non-empty event list, and that whatever it
// decodes survives a re-encode/decode round trip unchanged.
//
//	go test -run='^$' -fuzz=FuzzDecode -fuzztime=60s ./kvevents/
func FuzzDecode(f *testing.F) {
	for _, form := range []Encoding{EncodingMap, EncodingArray, EncodingMapEnvelope} {
		p, err := Encode(sampleBatch(4, 4), form)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(p)
		f.Add(p[:len(p)/2])
		f.Add(p[:len(p)-1])
	}
	f.Add([]byte(mp{}.arr(2).f64(1).arr(2).arr(5).str("BlockStored").arr(1).int(-9).nil_().tokens(0, 4).uint(4).arr(1).str("AllBlocksCleared")))
	f.Add([]byte(mp{}.mapn(2).str("ts").f64(2).str("events").arr(1).mapn(2).str("type").str("BlockRemoved").str("block_hashes").arr(1).bin([]byte("abcdefgh"))))
	f.Add([]byte(mp{}.arr(2).f64(1).arr(1).arr(1).str("Unknown")))
	f.Add([]byte(deepNest(40)))
	f.Add([]byte{})
	f.Add([]byte{0xc1})
	f.Add([]byte{0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte("\x92\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x91\xdb\xff\xff\xff\xff"))

	golden, _ := filepath.Glob(filepath.Join("testdata", "golden_*.msgpack"))
	for _, g := range golden {
		p, err := os.ReadFile(g)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(p)
	}

	d := NewDecoder()
	var b Batch
	f.Fuzz(func(t *testing.T, p []byte) {
		_, err := d.Decode(p, &b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrNoEvents) {
				t.Fatalf("error %v wraps no sentinel", err)
			}
			return
		}
		if len(b.Events) == 0 {
			t.Fatal("nil error with no events")
		}
		for i, ev := range b.Events {
			switch ev.Kind {
			case KindBlockStored:
				if ev.Stored == nil || ev.Removed != nil {
					t.Fatalf("event %d: bodies do not match kind", i)
				}
			case KindBlockRemoved:
				if ev.Removed == nil || ev.Stored != nil {
					t.Fatalf("event %d: bodies do not match kind", i)
				}
			case KindAllBlocksCleared:
				if ev.Removed != nil || ev.Stored != nil {
					t.Fatalf("event %d: bodies do not match kind", i)
				}
			default:
				t.Fatalf("event %d: kind %d", i, ev.Kind)
			}
		}
		for _, form := range []Encoding{EncodingMap, EncodingArray, EncodingMapEnvelope} {
			q, err := Encode(&b, form)
			if err != nil {
				t.Fatalf("re-encode %v: %v", form, err)
			}
			again, err := Decode(q)
			if err != nil {
				t.Fatalf("decode of re-encoded %v: %v", form, err)
			}
			if len(again.Events) != len(b.Events) || again.TS != b.TS && b.TS == b.TS {
				t.Fatalf("round trip %v changed the batch", form)
			}
		}
	})
}
