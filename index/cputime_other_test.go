//go:build !unix

package index

import "time"

func processCPU() (time.Duration, bool) { return 0, false }
