//go:build unix

package index

import (
	"syscall"
	"time"
)

// processCPU returns the CPU time this process has used (user + system), so
// benchmarks can report throughput per CPU-second on a machine that other
// work shares.
func processCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
