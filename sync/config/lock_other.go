//go:build !unix

package config

// lockDir is a no-op where flock is unavailable; the raft log's own lock
// still prevents two processes from sharing a data dir (by blocking).
func lockDir(string) (func() error, error) { return func() error { return nil }, nil }
