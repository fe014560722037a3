package node

import _ "embed"

// ConfigSource is the Go source of Config and ClusterConfig, embedded so
// that `kvmesh config reference` documents every field with its own doc
// comment: the comments stay the one place a knob is described.
//
//go:embed config.go
var configSource []byte

//go:embed clusterconfig.go
var clusterConfigSource []byte

//go:embed epp.go
var eppConfigSource []byte

//go:embed discovery.go
var discoveryConfigSource []byte

// ConfigSources returns the embedded sources of Config's types.
func ConfigSources() [][]byte {
	return [][]byte{configSource, clusterConfigSource, eppConfigSource, discoveryConfigSource}
}
