package node

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestOpenAIClientThroughCluster runs the official openai npm client
// (testdata/openaiclient, `npm ci` there; .ci/run does it) through a
// two-gateway cluster in front of three vllmsim engines: chat with an
// image part, completions with a prompt list, the Responses API (create,
// streamed and not, a follow-up with previous_response_id on the other
// gateway, retrieve and delete by id), embeddings, and an audio
// transcription of a generated WAV file. Each case is a subtest (one node
// process each). Without node or the package it skips and says so.
func TestOpenAIClientThroughCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("openai client through a cluster: skipped with -short")
	}
	nodeBin, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node not found: the openai client test needs node and `npm ci` in node/testdata/openaiclient")
	}
	dir := filepath.Join("testdata", "openaiclient")
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "openai", "package.json")); err != nil {
		t.Skip("the openai npm package is not installed: run `npm ci` in node/testdata/openaiclient")
	}
	e1, e2, e3 := startSimM(t), startSimM(t), startSimM(t)
	reps := []ReplicaConfig{simReplica("e1", e1), simReplica("e2", e2), simReplica("e3", e3)}
	g1, _ := startGateway(t, gwConfig("gw-a", t.TempDir(), nil, 2, reps...))
	g2, _ := startGateway(t, gwConfig("gw-b", t.TempDir(), []string{g1.Cluster().GossipAddr()}, 2, reps...))
	waitReady(t, g1, g2)

	for _, name := range []string{"chat-image", "completions-batch", "responses", "embeddings", "transcription"} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, nodeBin, "client.mjs", name)
			cmd.Dir = dir
			cmd.Env = append(os.Environ(), "KVMESH_GW1=http://"+g1.HTTPAddr(), "KVMESH_GW2=http://"+g2.HTTPAddr(), "KVMESH_MODEL=m")
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Run(); err != nil {
				t.Fatalf("node client.mjs %s: %v\n%s", name, err, out.String())
			}
			t.Logf("%s", bytes.TrimSpace(out.Bytes()))
		})
	}
}
