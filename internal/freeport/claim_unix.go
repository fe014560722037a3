//go:build unix

package freeport

import (
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// claim takes port p for this process against every other process that
// uses this package on the machine (concurrent test binaries, and
// concurrent clones of the repository running their tests): an exclusive
// flock on a file named after the port in a shared directory. It reports
// false when another process holds the claim. The claim lasts until
// release or the process's exit (the kernel drops the lock with the
// file). Without the directory or flock the port is not claimed, and
// release does nothing.
func claim(p int) (release func(), ok bool) {
	dir := filepath.Join(os.TempDir(), "kvmesh-freeport")
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return func() {}, true
	}
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(p)), os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		return func() {}, true
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if err == syscall.EWOULDBLOCK {
			return nil, false // another process's
		}
		return func() {}, true
	}
	return func() { f.Close() }, true
}
