//go:build race

package main

// raceEnabled: the race detector slows the live grids several-fold.
const raceEnabled = true
