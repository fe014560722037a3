//go:build !race

package cluster_test

// deadlineScale: see race_on_test.go.
const deadlineScale = 1
