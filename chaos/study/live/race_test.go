//go:build race

package live_test

// raceEnabled: the race detector slows the tiny grid from ~15 s to ~80 s.
const raceEnabled = true
