//go:build !linux

package deploy_test

import "os/exec"

// setParentDeathSignal is Linux-only (Pdeathsig); elsewhere the cleanup
// functions stop the processes.
func setParentDeathSignal(*exec.Cmd) {}
