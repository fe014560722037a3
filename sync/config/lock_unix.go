//go:build unix

package config

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// lockDir takes an exclusive, non-blocking lock on dir/LOCK, so a second
// process on the same data dir fails at once instead of hanging on the
// raft log's own (blocking) lock. The lock is released by unlock or when
// the process exits.
func lockDir(dir string) (unlock func() error, err error) {
	f, err := os.OpenFile(dir+"/LOCK", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("config: data dir lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: data dir %s is in use by another process", ErrInvalidStoreConfig, dir)
		}
		return nil, fmt.Errorf("config: data dir lock: %w", err)
	}
	return f.Close, nil // closing the descriptor releases the lock
}
