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
//
// release removes the file before it unlocks, so claims leave nothing
// behind. Another process may have opened the file just before that and
// lock it just after, on a name no longer there: a claim therefore holds
// only when, once locked, the name still leads to the file it locked, and
// otherwise tries again with the file now at that name.
func claim(p int) (release func(), ok bool) {
	dir := filepath.Join(os.TempDir(), "kvmesh-freeport")
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return func() {}, true
	}
	path := filepath.Join(dir, strconv.Itoa(p))
	for range 8 {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o666)
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
		held, err1 := f.Stat()
		named, err2 := os.Stat(path)
		if err1 == nil && err2 == nil && os.SameFile(held, named) {
			return func() {
				_ = os.Remove(path)
				f.Close()
			}, true
		}
		f.Close() // released and removed meanwhile: the name has moved on
	}
	return nil, false
}
