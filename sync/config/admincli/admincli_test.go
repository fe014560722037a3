package admincli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/freeport"
	"github.com/kvmesh/kvmesh/sync/config"
)

const token = "cli-test-token"

// The test binary doubles as $EDITOR: with KVMESH_TEST_EDITOR set it edits
// the file named by its argument and exits.
func TestMain(m *testing.M) {
	if mode := os.Getenv("KVMESH_TEST_EDITOR"); mode != "" {
		fakeEditor(mode, os.Args[len(os.Args)-1])
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

func fakeEditor(mode, path string) {
	data, err := os.ReadFile(path)
	if err != nil {
		panic(err)
	}
	count := os.Getenv("KVMESH_TEST_EDITOR_COUNT")
	calls := 0
	if b, err := os.ReadFile(count); err == nil {
		calls = len(b)
	}
	_ = os.WriteFile(count, bytes.Repeat([]byte("x"), calls+1), 0o600)
	s := string(data)
	switch mode {
	case "noop":
	case "imbalance":
		s = strings.Replace(s, `"imbalance_abs_count": 16`, `"imbalance_abs_count": 5`, 1)
	case "conflict":
		s = strings.Replace(s, `"imbalance_abs_count": 16`, `"imbalance_abs_count": 5`, 1)
		// Someone else writes while the user edits.
		cl, err := config.Dial(os.Getenv("KVMESH_ADMIN_ADDR"), config.ClientOptions{Token: token})
		if err != nil {
			panic(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if _, err := cl.PatchConfig(ctx, []byte(`{"strategy":"cost"}`), nil); err != nil {
			panic(err)
		}
		cancel()
		_ = cl.Close()
	case "invalid-then-fix":
		if calls == 0 {
			s = strings.Replace(s, `"url": "http://127.0.0.1:8000"`, `"url": "nope"`, 1)
		} else {
			s = strings.Replace(s, `"url": "nope"`, `"url": "http://127.0.0.1:8009"`, 1)
		}
	}
	if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
		panic(err)
	}
}

// gateway is a one-node config store with its admin gRPC server.
type gateway struct {
	store *config.Store
	addr  string
}

func startGateway(t *testing.T) *gateway {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	cfg := config.LocalStoreConfig()
	cfg.NodeID = "g0"
	cfg.DataDir = t.TempDir()
	cfg.BootstrapExpect = 1
	members := config.NewStaticMembership()
	cfg.Membership = members
	cfg.Logger = slog.New(slog.DiscardHandler)
	store, err := config.Open(cfg)
	require.NoError(t, err)
	members.Set(config.Member{ID: "g0", RaftAddr: store.RaftAddr(), AdminAddr: lis.Addr().String()})
	srv, err := config.NewServer(store, config.ServerConfig{Token: token, Logger: cfg.Logger})
	require.NoError(t, err)
	gs, err := config.NewGRPCServer(srv, config.TLSFiles{})
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = gs.Serve(lis) }()
	t.Cleanup(func() {
		gs.Stop()
		wg.Wait()
		require.NoError(t, store.Shutdown())
	})
	require.Eventually(t, store.IsLeader, 10*time.Second, 10*time.Millisecond)
	return &gateway{store: store, addr: lis.Addr().String()}
}

// run executes args against root made of the package's commands.
func run(t *testing.T, g *gateway, stdin string, args ...string) (string, string, error) {
	t.Helper()
	t.Setenv(AddrEnv, g.addr) // read when the commands are built
	root := &cobra.Command{Use: "kvmesh", SilenceUsage: true, SilenceErrors: true}
	root.AddCommand(Commands()...)
	root.AddCommand(NewExplainCmd())
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetIn(strings.NewReader(stdin))
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), errOut.String(), err
}

const doc = `{"models":{"chat":{"replicas":[
  {"name":"r0","url":"http://127.0.0.1:8000"},
  {"name":"r1","url":"http://127.0.0.1:8001"}]}}}`

func TestConfigSetGetPatch(t *testing.T) {
	g := startGateway(t)
	t.Setenv(config.TokenEnv, token)

	_, _, err := run(t, g, doc, "config", "set", "-f", "-", "--token", "wrong")
	require.ErrorIs(t, err, config.ErrUnauthenticated)

	out, _, err := run(t, g, doc, "config", "set", "-f", "-")
	require.NoError(t, err)
	require.Contains(t, out, "applied version")

	out, _, err = run(t, g, "", "config", "get")
	require.NoError(t, err)
	var got config.Versioned
	require.NoError(t, json.Unmarshal([]byte(out), &got))
	require.Equal(t, g.store.Current().Version, got.Version)
	require.Len(t, got.Config.Models["chat"].Replicas, 2)

	// `get` output fed back to `set` is a compare-and-set on its version.
	require.Equal(t, "cost", got.Config.Strategy, "the default")
	_, _, err = run(t, g, "", "config", "patch", `{"strategy":"least-request"}`)
	require.NoError(t, err)
	_, _, err = run(t, g, out, "config", "set", "-f", "-")
	require.ErrorIs(t, err, config.ErrVersionConflict)
	_, _, err = run(t, g, out, "config", "set", "-f", "-", "--force")
	require.NoError(t, err)
	require.Equal(t, "cost", g.store.Current().Config.Strategy)

	// Invalid documents are refused with the field named, locally or remotely.
	_, _, err = run(t, g, `{"models":{"chat":{"replicas":[{"name":"r0","url":"x"}]}}}`, "config", "set", "-f", "-")
	require.ErrorIs(t, err, config.ErrInvalidConfig)
	require.Contains(t, err.Error(), `models["chat"].replicas[0].url`)
	_, _, err = run(t, g, "", "config", "patch", `{"prefix_cache":{"stddev_factor":-1}}`)
	require.ErrorIs(t, err, config.ErrInvalidConfig)

	// YAML with the same keys.
	yml := "hash_seed: 18446744073709551615\nmodels:\n  chat:\n    strategy: cost\n    replicas:\n      - name: y0\n        url: http://127.0.0.1:8100\n"
	_, _, err = run(t, g, yml, "config", "set", "-f", "-")
	require.NoError(t, err)
	cur := g.store.Current().Config
	require.Equal(t, uint64(1<<64-1), cur.HashSeed)
	require.Equal(t, "cost", cur.Models["chat"].Strategy)
	_, _, err = run(t, g, "models: [unclosed", "config", "set", "-f", "-")
	require.ErrorIs(t, err, config.ErrInvalidConfig)

	// Token from a file.
	t.Setenv(config.TokenEnv, "")
	tf := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tf, []byte(token+"\n"), 0o600))
	_, _, err = run(t, g, "", "config", "get", "--token-file", tf)
	require.NoError(t, err)
	_, _, err = run(t, g, "", "config", "get")
	require.ErrorIs(t, err, config.ErrUnauthenticated)
}

func setEditor(t *testing.T, mode string) string {
	exe, err := os.Executable()
	require.NoError(t, err)
	t.Setenv("VISUAL", "")
	t.Setenv("EDITOR", exe)
	t.Setenv("KVMESH_TEST_EDITOR", mode)
	count := filepath.Join(t.TempDir(), "count")
	t.Setenv("KVMESH_TEST_EDITOR_COUNT", count)
	return count
}

func editorCalls(t *testing.T, count string) int {
	b, err := os.ReadFile(count)
	require.NoError(t, err)
	return len(b)
}

func TestConfigEdit(t *testing.T) {
	g := startGateway(t)
	t.Setenv(config.TokenEnv, token)
	_, _, err := run(t, g, doc, "config", "set", "-f", "-")
	require.NoError(t, err)

	setEditor(t, "noop")
	out, _, err := run(t, g, "", "config", "edit")
	require.NoError(t, err)
	require.Contains(t, out, "no changes")

	setEditor(t, "imbalance")
	_, _, err = run(t, g, "", "config", "edit")
	require.NoError(t, err)
	require.Equal(t, 5, g.store.Current().Config.PrefixCache.ImbalanceAbsCount)
}

func TestConfigEditRetriesOnConflict(t *testing.T) {
	g := startGateway(t)
	t.Setenv(config.TokenEnv, token)
	_, _, err := run(t, g, doc, "config", "set", "-f", "-")
	require.NoError(t, err)

	setEditor(t, "conflict")
	_, stderr, err := run(t, g, "", "config", "edit")
	require.NoError(t, err)
	require.Contains(t, stderr, "re-applying your changes")
	cur := g.store.Current().Config
	require.Equal(t, 5, cur.PrefixCache.ImbalanceAbsCount, "the user's change")
	require.Equal(t, "cost", cur.Strategy, "the concurrent change survives")
}

func TestConfigEditReopensOnInvalid(t *testing.T) {
	g := startGateway(t)
	t.Setenv(config.TokenEnv, token)
	_, _, err := run(t, g, doc, "config", "set", "-f", "-")
	require.NoError(t, err)
	count := setEditor(t, "invalid-then-fix")
	_, stderr, err := run(t, g, "", "config", "edit")
	require.NoError(t, err)
	require.Contains(t, stderr, `models["chat"].replicas[0].url`)
	require.Equal(t, 2, editorCalls(t, count))
	require.Equal(t, "http://127.0.0.1:8009", g.store.Current().Config.Models["chat"].Replicas[0].URL)
}

func TestMembersAndExplain(t *testing.T) {
	g := startGateway(t)
	t.Setenv(config.TokenEnv, token)
	out, _, err := run(t, g, "", "members")
	require.NoError(t, err)
	require.Contains(t, out, "ID")
	require.Regexp(t, `g0\s+voter\s+\*\s+true`, out)
	out, _, err = run(t, g, "", "members", "--json")
	require.NoError(t, err)
	require.Contains(t, out, `"id": "g0"`)

	_, _, err = run(t, g, "", "explain")
	require.Error(t, err)
	_, _, err = run(t, g, "", "explain", "--model", "chat", "--prompt", "hi")
	require.ErrorIs(t, err, config.ErrUnavailable, "this gateway has no explainer wired")
}

// TestUnreachableAdminAddrSaysWhat: with nothing listening, every admin
// command names the address it tried and how to give another, instead of
// gRPC's raw dial error.
func TestUnreachableAdminAddrSaysWhat(t *testing.T) {
	addr := freeport.Refusing(t) // a port nobody listens on, held for the test
	for _, args := range [][]string{{"members"}, {"config", "get"}} {
		root := &cobra.Command{Use: "kvmesh", SilenceUsage: true, SilenceErrors: true}
		root.AddCommand(Commands()...)
		root.SetArgs(append(args, "--admin-addr", addr, "--token", token, "--timeout", "5s"))
		err := root.Execute()
		require.ErrorIs(t, err, ErrUnreachable, "%v", args)
		require.Contains(t, err.Error(), addr)
		require.Contains(t, err.Error(), "--admin-addr HOST:PORT")
	}
	t.Setenv(AddrEnv, "")
	root := &cobra.Command{Use: "kvmesh", SilenceUsage: true, SilenceErrors: true}
	root.AddCommand(Commands()...)
	root.SetArgs([]string{"members", "--token", token, "--timeout", "2s"})
	if err := root.Execute(); errors.Is(err, ErrUnreachable) {
		require.Contains(t, err.Error(), "no --admin-addr given")
	}
}
