package config

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestFuncMembershipNotifies(t *testing.T) {
	var n atomic.Int32
	f := NewFuncMembership(func() []Member {
		out := make([]Member, n.Load())
		for i := range out {
			out[i] = Member{ID: string(rune('a' + i))}
		}
		return out
	})
	ch := f.Changed()
	require.Empty(t, f.Members())
	n.Store(2)
	select {
	case <-ch:
		t.Fatal("closed before Notify")
	default:
	}
	f.Notify()
	<-ch // closed now
	require.Len(t, f.Members(), 2)
	require.NotEqual(t, ch, f.Changed(), "a fresh channel after each change")
}

func TestStaticMembershipAndSmallestIDs(t *testing.T) {
	s := NewStaticMembership(Member{ID: "c"}, Member{ID: "a"})
	ch := s.Changed()
	s.Upsert(Member{ID: "b", RaftAddr: "x"})
	<-ch
	s.Upsert(Member{ID: "b", RaftAddr: "y"})
	m, ok := lookup(s, "b")
	require.True(t, ok)
	require.Equal(t, "y", m.RaftAddr)
	got := smallestIDs(s.Members(), 2)
	require.Equal(t, []string{"a", "b"}, []string{got[0].ID, got[1].ID})
	s.Remove("a")
	_, ok = lookup(s, "a")
	require.False(t, ok)
	addr, err := addressProvider{s}.ServerAddr("b")
	require.NoError(t, err)
	require.Equal(t, "y", string(addr))
	_, err = addressProvider{s}.ServerAddr("a")
	require.Error(t, err)
}
