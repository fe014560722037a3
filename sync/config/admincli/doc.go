// Package admincli is the command-line side of kvmesh's admin API: cobra
// commands that talk to a gateway's Admin gRPC service (sync/config).
//
//	kvmesh config get                      the applied config as {"version","config"}
//	kvmesh config set -f cfg.json          replace it (JSON or YAML; a {"version","config"} file is a compare-and-set)
//	kvmesh config patch '{"strategy":"cost"}'   RFC 7386 merge patch
//	kvmesh config edit                     $EDITOR on the document; validates; retries on version conflict
//	kvmesh members                         gateways with their raft role
//	kvmesh explain --model M --prompt P    how the gateway would route a prompt
//
// The commands use gRPC (the same client gateways use to forward writes),
// so errors keep their kind: an invalid config names the field, a version
// conflict or a missing quorum says so. Connection flags are shared:
// --admin-addr (default $KVMESH_ADMIN_ADDR, else 127.0.0.1:7948, the
// gateway's default admin port), --token
// (default $KVMESH_ADMIN_TOKEN, else --token-file), --tls-ca, --tls-cert,
// --tls-key, --timeout.
//
// Add them to a root command with
//
//	root.AddCommand(admincli.Commands()...)
//
// and admincli.NewExplainCmd() where an explain command is wanted.
package admincli
