package config

import (
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStopHeartbeatsWaitsForTheRunningOne: the store's transport runs
// raft's heartbeat handler behind a guard. stopHeartbeats (Shutdown calls
// it before closing the log) returns only once a heartbeat in progress
// has finished, and later heartbeats are answered "transport shutdown"
// without reaching raft. Real NetworkTransports over loopback TCP.
func TestStopHeartbeatsWaitsForTheRunningOne(t *testing.T) {
	srv, err := raft.NewTCPTransport("127.0.0.1:0", nil, 2, 5*time.Second, io.Discard)
	require.NoError(t, err)
	defer srv.Close()
	tr := &noPipelineTransport{NetworkTransport: srv}
	started, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	tr.SetHeartbeatHandler(func(rpc raft.RPC) {
		if calls.Add(1) == 1 {
			close(started)
			<-release
		}
		rpc.Respond(&raft.AppendEntriesResponse{Term: 1, Success: true}, nil)
	})

	cli, err := raft.NewTCPTransport("127.0.0.1:0", nil, 2, 5*time.Second, io.Discard)
	require.NoError(t, err)
	defer func() {
		cli.CloseStreams() // the server's connection handlers exit
		_ = cli.Close()
	}()
	heartbeat := func() error {
		var resp raft.AppendEntriesResponse
		return cli.AppendEntries("s", srv.LocalAddr(), &raft.AppendEntriesRequest{
			RPCHeader: raft.RPCHeader{Addr: []byte("127.0.0.1:1")}, Term: 1}, &resp)
	}
	first := make(chan error, 1)
	go func() { first <- heartbeat() }()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the heartbeat did not reach the handler")
	}

	stopped := make(chan struct{})
	go func() {
		tr.stopHeartbeats()
		close(stopped)
	}()
	require.Eventually(t, func() bool {
		tr.hbMu.Lock()
		defer tr.hbMu.Unlock()
		return tr.hbStopped
	}, 10*time.Second, time.Millisecond)
	select {
	case <-stopped:
		t.Fatal("stopHeartbeats returned while a heartbeat was running")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("stopHeartbeats did not return after the heartbeat ended")
	}
	require.NoError(t, <-first)

	require.ErrorContains(t, heartbeat(), raft.ErrTransportShutdown.Error())
	assert.EqualValues(t, 1, calls.Load(), "a heartbeat after stopHeartbeats does not reach raft")
}
