package kvevents

import "testing"

// go test -run='^$' -bench=. -benchtime=200ms ./kvevents/

func oneStored16() *Batch {
	b := sampleBatch(16, 16)
	b.Events = b.Events[:1]
	return b
}

func BenchmarkDecodeStored16(b *testing.B) {
	for _, form := range []Encoding{EncodingMap, EncodingArray, EncodingMapEnvelope} {
		b.Run(form.String(), func(b *testing.B) {
			p, err := Encode(oneStored16(), form)
			if err != nil {
				b.Fatal(err)
			}
			d := NewDecoder()
			var out Batch
			b.SetBytes(int64(len(p)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := d.Decode(p, &out); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/16, "ns/block")
		})
	}
}

// BenchmarkDecodeStored16Fresh decodes into a new Batch each time, as a
// consumer that keeps every batch would.
func BenchmarkDecodeStored16Fresh(b *testing.B) {
	p, err := Encode(oneStored16(), EncodingMap)
	if err != nil {
		b.Fatal(err)
	}
	d := NewDecoder()
	b.ReportAllocs()
	for b.Loop() {
		var out Batch
		if _, err := d.Decode(p, &out); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkEncodeStored16(b *testing.B) {
	for _, form := range []Encoding{EncodingMap, EncodingArray, EncodingMapEnvelope} {
		b.Run(form.String(), func(b *testing.B) {
			e := NewEncoder(form)
			in := oneStored16()
			var dst []byte
			b.ReportAllocs()
			for b.Loop() {
				var err error
				if dst, err = e.Append(dst[:0], in); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkPublish measures Publish (encode, ring, queue) with a replay ring
// and no subscriber.
func BenchmarkPublish(b *testing.B) {
	cfg := testPublisherConfig()
	cfg.HWM = 1000
	p, err := NewPublisher(cfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	in := *oneStored16()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := p.Publish(in); err != nil {
			b.Fatal(err)
		}
	}
}
