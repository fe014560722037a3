package kvevents

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Interop with libzmq: Python scripts in testdata play vLLM's side with
// pyzmq and msgpack (Debian: python3-zmq python3-msgpack). The tests skip
// when no python3 with both modules is found; KVMESH_PYTHON names one.

func interopPython(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("interop tests spawn python; skipped with -short")
	}
	cands := []string{os.Getenv("KVMESH_PYTHON"), "/usr/bin/python3", "python3"}
	for _, c := range cands {
		if c == "" {
			continue
		}
		if err := exec.Command(c, "-c", "import zmq, msgpack").Run(); err == nil {
			return c
		}
	}
	t.Skip("no python3 with zmq and msgpack (apt-get install python3-zmq python3-msgpack)")
	return ""
}

// startScript runs a testdata script and returns its stdout lines; the
// process ends when the test does (its stdin closes, then it is killed).
func startScript(t *testing.T, py string, args ...string) <-chan string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, py, args...)
	cmd.Dir = "testdata"
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	lines := make(chan string, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			lines <- sc.Text()
		}
		_, _ = io.Copy(io.Discard, stdout)
	}()
	t.Cleanup(func() {
		_ = stdin.Close()
		timer := time.AfterFunc(5*time.Second, cancel)
		<-done
		_ = cmd.Wait()
		timer.Stop()
		cancel()
	})
	return lines
}

func nextLine(t *testing.T, lines <-chan string) string {
	t.Helper()
	select {
	case l, ok := <-lines:
		require.True(t, ok, "script exited")
		return l
	case <-time.After(15 * time.Second):
		t.Fatal("script printed nothing for 15s")
	}
	return ""
}

// TestInteropLibzmqPublisher: our Subscriber consumes a libzmq PUB and
// joins late through a libzmq ROUTER's replay, every form and reply form.
func TestInteropLibzmqPublisher(t *testing.T) {
	py := interopPython(t)
	const count = 60
	for _, form := range []string{"array", "map", "map-envelope"} {
		for _, reply := range []string{"with-topic", "no-topic"} {
			t.Run(form+"/"+reply, func(t *testing.T) {
				lines := startScript(t, py, "vllm_like_publisher.py", form, reply, fmt.Sprint(count))
				pubAddr := strings.TrimPrefix(nextLine(t, lines), "PUB ")
				routerAddr := strings.TrimPrefix(nextLine(t, lines), "ROUTER ")
				require.Equal(t, "SENT 5", nextLine(t, lines))
				h := &recorder{}
				m := NewMetrics()
				cfg := testSubscriberConfig(pubAddr, routerAddr)
				cfg.Topic = "kv"
				startSubscriber(t, cfg, h, m, nil)
				require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == count-1 },
					10*time.Second, 10*time.Millisecond)
				want := Seq(0)
				for _, r := range h.snapshot() {
					require.Zero(t, r.reset)
					require.Equal(t, want, r.seq)
					require.Equal(t, EngineHash(1<<63+uint64(r.seq)), r.hash)
					want++
				}
				require.Equal(t, Seq(count), want)
				require.Zero(t, counterValue(t, m.Malformed.WithLabelValues("r1")))
				// The catch-up on connect, and a gap replay when batches
				// went out before the subscription reached the PUB. A
				// replay is counted when it ends, after its batches.
				require.Eventually(t, func() bool {
					return counterValue(t, m.Replays.WithLabelValues("r1", replayComplete)) >= 1
				}, 5*time.Second, 5*time.Millisecond, "seq 0..4 came through the libzmq ROUTER")
				require.Zero(t, counterValue(t, m.Replays.WithLabelValues("r1", replayFailed)))
			})
		}
	}
}

// TestInteropLibzmqConsumer: a libzmq SUB and DEALER read our Publisher's
// live stream and replay, and Python's msgpack decodes the payloads.
func TestInteropLibzmqConsumer(t *testing.T) {
	py := interopPython(t)
	for _, reply := range []ReplayForm{ReplayWithTopic, ReplayNoTopic} {
		t.Run(reply.String(), func(t *testing.T) {
			cfg := testPublisherConfig()
			cfg.Topic = "kv"
			cfg.ReplayForm = reply
			p := newPublisher(t, cfg)
			lines := startScript(t, py, "vllm_like_consumer.py", p.Addr(), p.ReplayAddr())
			var n Seq
			var live string
			deadline := time.After(15 * time.Second)
		publish:
			for {
				_, err := p.Publish(batchFor(n, 11))
				require.NoError(t, err)
				n++
				select {
				case live = <-lines:
					break publish
				case <-deadline:
					t.Fatal("consumer saw no live message")
				case <-time.After(10 * time.Millisecond):
				}
			}
			require.True(t, strings.HasPrefix(live, "live 3 "), live)
			liveSeq, err := strconv.ParseUint(strings.Fields(live)[2], 10, 64)
			require.NoError(t, err, live)
			wantFrames := "4"
			if reply == ReplayNoTopic {
				wantFrames = "3"
			}
			// The replay holds every batch published before the request:
			// at least through the live one, at most the n published (the
			// loop may publish more while the consumer's line is on its way).
			end := fmt.Sprintf("replay %s %d \"\"", wantFrames, uint64(ReplayEnd))
			for s := Seq(0); ; s++ {
				l := nextLine(t, lines)
				if l == end {
					require.Greater(t, uint64(s), liveSeq, "the replay stopped before the live batch")
					require.LessOrEqual(t, s, n)
					break
				}
				require.Less(t, s, n, "replayed more than was published: %s", l)
				require.True(t, strings.HasPrefix(l, fmt.Sprintf("replay %s %d ", wantFrames, s)), l)
				require.Contains(t, l, `{"type": "BlockStored", "block_hashes": [`+fmt.Sprint(uint64(hashFor(s, 11)))+`]`)
			}
		})
	}
}
