package config

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLoadToken(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "tok")
	require.NoError(t, os.WriteFile(file, []byte("from-file\nignored\n"), 0o600))
	t.Setenv(TokenEnv, "")
	tok, err := LoadToken("", file)
	require.NoError(t, err)
	require.Equal(t, "from-file", tok)
	t.Setenv(TokenEnv, "from-env")
	tok, err = LoadToken("", file)
	require.NoError(t, err)
	require.Equal(t, "from-env", tok)
	tok, err = LoadToken("from-flag", file)
	require.NoError(t, err)
	require.Equal(t, "from-flag", tok)
	t.Setenv(TokenEnv, "")
	_, err = LoadToken("", filepath.Join(dir, "missing"))
	require.Error(t, err)
}

func TestEnsureTokenFile(t *testing.T) {
	t.Setenv(TokenEnv, "")
	file := filepath.Join(t.TempDir(), "admin-token")
	a, err := EnsureTokenFile(file)
	require.NoError(t, err)
	require.Len(t, a, 64)
	st, err := os.Stat(file)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	b, err := EnsureTokenFile(file)
	require.NoError(t, err)
	require.Equal(t, a, b, "an existing token is kept")
}

func TestAuthenticatorCheck(t *testing.T) {
	a := newAuthenticator("tok", false)
	require.NoError(t, a.check("Bearer tok", true))
	require.ErrorIs(t, a.check("Bearer tok2", true), ErrUnauthenticated)
	require.ErrorIs(t, a.check("tok", false), ErrUnauthenticated)
	require.ErrorIs(t, a.check("Bearer ", false), ErrUnauthenticated)
	open := newAuthenticator("tok", true)
	require.NoError(t, open.check("", false))
	require.ErrorIs(t, open.check("", true), ErrUnauthenticated)
}

func TestDataDirLocked(t *testing.T) {
	c := newCluster(t, 1, 1, false, nil)
	nd := c.waitLeader(10 * time.Second)
	cfg := LocalStoreConfig()
	cfg.NodeID = "other"
	cfg.DataDir = nd.dir
	cfg.Membership = NewStaticMembership()
	cfg.Logger = discard()
	_, err := Open(cfg)
	require.ErrorIs(t, err, ErrInvalidStoreConfig)
	require.Contains(t, err.Error(), "in use")
}

func TestStoreConfigValidate(t *testing.T) {
	base := LocalStoreConfig()
	base.NodeID, base.DataDir, base.Membership = "n", "/tmp/x", NewStaticMembership()
	require.NoError(t, base.Validate())
	bad := testConfig()
	bad.Strategy = "nope"
	for name, mutate := range map[string]func(*StoreConfig){
		"no id":       func(c *StoreConfig) { c.NodeID = "" },
		"no dir":      func(c *StoreConfig) { c.DataDir = "" },
		"no members":  func(c *StoreConfig) { c.Membership = nil },
		"expect 0":    func(c *StoreConfig) { c.BootstrapExpect = 0 },
		"bad seed":    func(c *StoreConfig) { c.Seed = &bad },
		"raft":        func(c *StoreConfig) { c.LeaderLeaseTimeout = time.Hour },
		"log level":   func(c *StoreConfig) { c.RaftLogLevel = "loud" },
		"no timeout":  func(c *StoreConfig) { c.ApplyTimeout = 0 },
		"retain zero": func(c *StoreConfig) { c.SnapshotRetain = 0 },
	} {
		c := base
		mutate(&c)
		require.ErrorIs(t, c.Validate(), ErrInvalidStoreConfig, name)
	}
}
