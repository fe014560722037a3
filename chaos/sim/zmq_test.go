package sim

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/kvevents"
)

// liveMsg is one message received on the SUB socket.
type liveMsg struct {
	seq   kvevents.Seq
	batch *kvevents.Batch
}

// TestZMQLiveAndReplay runs a Server with the real kvevents publisher and
// checks, with real SUB and DEALER sockets, that live batches carry the
// request's blocks and that a replay from 0 returns every batch, in order,
// ending with the end marker, for each payload encoding and replay form.
func TestZMQLiveAndReplay(t *testing.T) {
	for _, tc := range []struct{ enc, form string }{
		{"map", "with-topic"},
		{"array", "no-topic"},
		{"map-envelope", "with-topic"},
	} {
		t.Run(tc.enc+"/"+tc.form, func(t *testing.T) {
			cfg := LocalConfig()
			cfg.KVEvents.EnableKVCacheEvents = true
			cfg.KVEvents.Topic = "kv@sim"
			cfg.KVEvents.Encoding = tc.enc
			cfg.KVEvents.ReplayForm = tc.form
			s, err := NewServer(cfg)
			require.NoError(t, err)
			require.NoError(t, s.Start(context.Background()))
			defer func() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				require.NoError(t, s.Shutdown(ctx))
			}()
			require.NotEmpty(t, s.KVEventsAddr())
			require.NotEmpty(t, s.KVReplayAddr())

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			sub := zmq4.NewSub(ctx)
			defer sub.Close()
			require.NoError(t, sub.Dial(s.KVEventsAddr()))
			require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, "kv@sim"))
			live := make(chan liveMsg, 1024)
			recvDone := make(chan struct{})
			go func() {
				defer close(recvDone)
				for {
					m, err := sub.Recv()
					if err != nil {
						return
					}
					if len(m.Frames) != 3 || string(m.Frames[0]) != "kv@sim" {
						t.Errorf("bad live message: %d frames", len(m.Frames))
						return
					}
					b, err := kvevents.Decode(m.Frames[2])
					if err != nil {
						t.Errorf("decode live: %v", err)
						return
					}
					live <- liveMsg{seq: kvevents.Seq(binary.BigEndian.Uint64(m.Frames[1])), batch: b}
				}
			}()
			defer func() { cancel(); sub.Close(); <-recvDone }()

			complete := func(prompt string) {
				resp, err := http.Post(s.URL()+"/v1/completions", "application/json",
					strings.NewReader(fmt.Sprintf(`{"prompt":%q,"max_tokens":2}`, prompt)))
				require.NoError(t, err)
				resp.Body.Close()
				require.Equal(t, http.StatusOK, resp.StatusCode)
			}
			// The subscription propagates asynchronously: publish warm-up
			// batches until one arrives (bounded).
			got := false
			for i := 0; i < 200 && !got; i++ {
				complete(fmt.Sprintf("warm-up request %03d padding to one block", i))
				select {
				case <-live:
					got = true
				case <-time.After(20 * time.Millisecond):
				}
			}
			require.True(t, got, "no live batch arrived")
			for len(live) > 0 {
				<-live
			}

			prompt := strings.Repeat("the block chain ", 8) // 128 bytes = 8 blocks
			complete(prompt)
			want := s.HashTokens(s.Tokenize(prompt))
			var stored []kvevents.EngineHash
			var lastSeq kvevents.Seq
			deadline := time.After(5 * time.Second)
			for len(stored) < len(want) {
				select {
				case m := <-live:
					lastSeq = m.seq
					for _, ev := range m.batch.Events {
						if ev.Kind == kvevents.KindBlockStored {
							if !ev.Stored.HasParent {
								require.Equal(t, want[0], ev.Stored.BlockHashes[0])
							}
							stored = append(stored, ev.Stored.BlockHashes...)
							require.Equal(t, "GPU", ev.Stored.Medium)
							require.Equal(t, 16, ev.Stored.BlockSize)
						}
					}
				case <-deadline:
					t.Fatalf("live batches for the request did not arrive; got %d of %d blocks", len(stored), len(want))
				}
			}
			require.Equal(t, want, stored)

			// Reset: AllBlocksCleared arrives live.
			require.True(t, s.ResetPrefixCache())
			select {
			case m := <-live:
				require.Equal(t, lastSeq+1, m.seq)
				require.Len(t, m.batch.Events, 1)
				require.Equal(t, kvevents.KindAllBlocksCleared, m.batch.Events[0].Kind)
				lastSeq = m.seq
			case <-time.After(5 * time.Second):
				t.Fatal("AllBlocksCleared did not arrive")
			}

			// Replay everything from 0 through a DEALER.
			dealer := zmq4.NewDealer(ctx)
			defer dealer.Close()
			require.NoError(t, dealer.Dial(s.KVReplayAddr()))
			start := make([]byte, 8)
			require.NoError(t, dealer.SendMulti(zmq4.NewMsgFrom([]byte{}, start)))
			m := mirror{}
			next := kvevents.Seq(0)
			for {
				msg, err := dealer.Recv()
				require.NoError(t, err)
				frames := msg.Frames
				if len(frames) > 0 && len(frames[0]) == 0 {
					frames = frames[1:] // delimiter
				}
				if tc.form == "with-topic" {
					require.Len(t, frames, 3)
					require.Equal(t, "kv@sim", string(frames[0]))
					frames = frames[1:]
				} else {
					require.Len(t, frames, 2)
				}
				seq := kvevents.Seq(binary.BigEndian.Uint64(frames[0]))
				if seq == kvevents.ReplayEnd {
					require.Empty(t, frames[1])
					break
				}
				require.Equal(t, next, seq)
				next++
				b, err := kvevents.Decode(frames[1])
				require.NoError(t, err)
				m.apply(t, b.Events)
			}
			require.Equal(t, lastSeq+1, next, "replay returned every batch")
			m.requireMatches(t, s)
		})
	}
}
