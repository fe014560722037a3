package logx

import (
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestTailKeepsTheLastWrites(t *testing.T) {
	l := NewTail(3)
	assert.Equal(t, "", l.String())
	for i := range 2 {
		fmt.Fprintf(l, "line %d\n", i)
	}
	assert.Equal(t, "line 0\nline 1\n", l.String())
	for i := 2; i < 7; i++ {
		fmt.Fprintf(l, "line %d\n", i)
	}
	assert.Equal(t, 3, l.Len())
	assert.Equal(t, "line 4\nline 5\nline 6\n", l.String())
}

// Under a slog handler every record is one write, so the tail holds
// whole records even when loggers on many goroutines share it.
func TestTailHoldsWholeRecords(t *testing.T) {
	l := NewTail(100)
	log := slog.New(slog.NewTextHandler(l, nil))
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 50 {
				log.Info("record", "goroutine", g, "i", i)
			}
		})
	}
	wg.Wait()
	lines := strings.Split(strings.TrimSuffix(l.String(), "\n"), "\n")
	require.Len(t, lines, 100)
	for _, s := range lines {
		assert.Regexp(t, `^time=\S+ level=INFO msg=record goroutine=\d i=\d+$`, s)
	}
}
