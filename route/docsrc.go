package route

import "embed"

// sources are this package's Go files, embedded so that `kvmesh config
// reference` documents the strategies' parameters with their own doc
// comments (the one place each is described).
//
//go:embed *.go
var sources embed.FS

// Sources returns the package's Go source files (tests excluded).
func Sources() [][]byte {
	entries, _ := sources.ReadDir(".")
	var out [][]byte
	for _, e := range entries {
		if n := e.Name(); len(n) > 8 && n[len(n)-8:] == "_test.go" {
			continue
		}
		b, err := sources.ReadFile(e.Name())
		if err == nil {
			out = append(out, b)
		}
	}
	return out
}
