//go:build !race

package node

import (
	"syscall"
	"unsafe"
)

// sysRead is read(2) as a raw system call (rawio.go); p is not empty.
func sysRead(fd uintptr, p []byte) (int, syscall.Errno) {
	n, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(n), e
}

// sysWrite is write(2) as a raw system call (rawio.go); p is not empty.
func sysWrite(fd uintptr, p []byte) (int, syscall.Errno) {
	n, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(n), e
}
