package deploy_test

import (
	"os/exec"
	"syscall"
)

// setParentDeathSignal makes the kernel kill cmd when the test process
// dies, so an aborted test run leaves no gateway or simulator behind.
func setParentDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
