// Package buildinfo is the one source of the version the three commands
// (kvmesh, vllmsim, kvbench) print with --version and the gateway exports
// as kvmesh_build_info.
//
// Version is set at link time:
//
//	go build -ldflags "-X github.com/kvmesh/kvmesh/internal/buildinfo.Version=v1.2.3" ./cmd/...
//
// Without it, Version is the main module's version as the go command
// recorded it ("(devel)" for a build from a checkout, a tag for
// `go install module@tag`), and Revision the VCS revision when the binary
// was built from a git checkout.
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
)

// Version is the release version; set with -ldflags -X (see the package
// doc). Empty means: take it from the Go build info.
var Version string

// Info describes the running binary.
type Info struct {
	Version   string // release version, "dev" when unknown
	Revision  string // VCS revision (12 hex digits, "+dirty" when modified), "unknown" when not recorded
	GoVersion string // the Go toolchain that built the binary
}

var (
	once sync.Once
	info Info
)

// Get returns the running binary's build information. Safe for concurrent
// use; the result never changes during a process's life.
func Get() Info {
	once.Do(func() {
		info = Info{Version: Version, Revision: "unknown", GoVersion: runtime.Version()}
		bi, ok := debug.ReadBuildInfo()
		if !ok {
			if info.Version == "" {
				info.Version = "dev"
			}
			return
		}
		if info.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			info.Version = bi.Main.Version
		}
		if info.Version == "" {
			info.Version = "dev"
		}
		var dirty bool
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				info.Revision = s.Value
				if len(info.Revision) > 12 {
					info.Revision = info.Revision[:12]
				}
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if dirty && info.Revision != "unknown" {
			info.Revision += "+dirty"
		}
	})
	return info
}

// String is the one-line --version answer for the command named cmd:
// "kvmesh v1.2.3 (revision 0123456789ab, go1.26.8)".
func String(cmd string) string {
	i := Get()
	return fmt.Sprintf("%s %s (revision %s, %s)", cmd, i.Version, i.Revision, i.GoVersion)
}
