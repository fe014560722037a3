package config

import _ "embed"

//go:embed document.go
var documentSource []byte

// DocumentSource returns the embedded source of RoutingConfig's types, so
// that `kvmesh config reference` documents every field of the cluster
// document with its own doc comment.
func DocumentSource() []byte { return documentSource }
