//go:build race

package node

import "syscall"

// sysRead is syscall.Read, whose race annotations order it after the
// write that sent its bytes (rawio.go); p is not empty.
func sysRead(fd uintptr, p []byte) (int, syscall.Errno) {
	return errnoOf(syscall.Read(int(fd), p))
}

// sysWrite is syscall.Write, with its race annotations (rawio.go); p is
// not empty.
func sysWrite(fd uintptr, p []byte) (int, syscall.Errno) {
	return errnoOf(syscall.Write(int(fd), p))
}

func errnoOf(n int, err error) (int, syscall.Errno) {
	if err != nil {
		if e, ok := err.(syscall.Errno); ok {
			return 0, e
		}
		return 0, syscall.EIO
	}
	return n, 0
}
