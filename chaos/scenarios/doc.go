// Package scenarios runs kvmesh's chaos suite (chaos/suite) as go tests: one
// test per scenario, each calling the suite's code on its *testing.T, and a
// table of every scenario's figures printed by TestMain (go test shows it
// with -v or on failure). The command kvmesh chaos runs the same scenarios
// through the same code (suite.Run) and writes the table as Markdown and
// JSON; the list and what each scenario checks are in chaos/suite's doc.
//
// The short form runs in CI in under a minute (about two under -race). The
// long form runs more requests and rounds:
//
//	KVMESH_CHAOS_LONG=1 go test ./chaos/scenarios -run . -v
//	go test ./chaos/scenarios -v -args -long
package scenarios
