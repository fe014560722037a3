//go:build race

package node

// raceEnabled: the race detector's shadow memory multiplies a process's
// resident set, so memory bounds meant for the production build do not
// apply.
const raceEnabled = true
