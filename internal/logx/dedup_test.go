package logx

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
)

func TestDedupKeepsEachKeyOnce(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(Dedup(slog.NewTextHandler(&buf, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				return slog.Attr{}
			}
			return a
		}})))
	sub := log.With("component", "vllmsim", "model", "M").With("component", "kvevents.publisher", "replica", "r1")
	sub.Info("ready", "replica", "r1", "seq", 3)
	sub.WithGroup("g").Info("grouped", "component", "x")
	got := buf.String()
	want := "level=INFO msg=ready component=kvevents.publisher model=M replica=r1 seq=3\n" +
		"level=INFO msg=grouped component=kvevents.publisher model=M replica=r1 g.component=x\n"
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
	if strings.Count(got, "replica=") != 2 {
		t.Fatalf("replica repeated: %s", got)
	}
}
