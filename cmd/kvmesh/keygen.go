package main

import (
	"fmt"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/node"
	"github.com/kvmesh/kvmesh/sync/trust"
)

// newKeygenCmd prints a new cluster key.
func newKeygenCmd() *cobra.Command {
	var id bool
	cmd := &cobra.Command{
		Use:   "keygen",
		Short: "Print a new cluster key",
		Long: `Print a new random cluster key (32 bytes, base64) on stdout.

Every gateway of a cluster needs the same key; from it each derives the gossip
encryption key, a cluster CA and its own certificate (mutual TLS on raft, the
peer port and NATS routes) and the NATS credentials:

	kvmesh keygen > cluster.key && chmod 600 cluster.key
	kvmesh serve --cluster-key-file cluster.key ...
	# or: export KVMESH_CLUSTER_KEY=$(kvmesh keygen)

With --id, read a key from stdin's first line instead and print its public
fingerprint (the key_id gateways log at start), to check two hosts hold the
same key without showing it. Key rotation: SECURITY.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if id {
				var line string
				if _, err := fmt.Fscanln(cmd.InOrStdin(), &line); err != nil {
					return fmt.Errorf("keygen --id: read a key from stdin: %w", err)
				}
				keys, err := trust.ParseKeys(line)
				if err != nil {
					return err
				}
				_, err = fmt.Fprintln(cmd.OutOrStdout(), trust.KeyID(keys[0]))
				return err
			}
			k, err := trust.Generate()
			if err != nil {
				return err
			}
			_, err = fmt.Fprintln(cmd.OutOrStdout(), k)
			return err
		},
	}
	cmd.Flags().BoolVar(&id, "id", false, "print the fingerprint of the key on stdin instead")
	return cmd
}

// addClusterTrustFlags registers the cluster-key and external-NATS flags
// of serve.
func addClusterTrustFlags(fl *pflag.FlagSet, c *node.ClusterConfig) {
	fl.StringVar(&c.ClusterKeyFile, "cluster-key-file", c.ClusterKeyFile,
		"file with the cluster key (kvmesh keygen; else $KVMESH_CLUSTER_KEY); every gateway needs the same, cluster mode refuses to start without it")
	fl.BoolVar(&c.Insecure, "insecure", c.Insecure,
		"run cluster mode without a cluster key: gossip, raft, peer and NATS ports accept anyone (logs a warning, exports kvmesh_insecure 1, default binds move to 127.0.0.1)")
	fl.StringVar(&c.NATSCredentialsFile, "nats-credentials-file", c.NATSCredentialsFile, "NATS .creds file for --nats-url")
	fl.StringVar(&c.NATSTLS.CAFile, "nats-tls-ca", "", "CA that --nats-url servers are verified against (PEM)")
	fl.StringVar(&c.NATSTLS.CertFile, "nats-tls-cert", "", "client certificate for --nats-url (PEM)")
	fl.StringVar(&c.NATSTLS.KeyFile, "nats-tls-key", "", "client key for --nats-url (PEM)")
}

// applyClusterTrustFlags copies the given cluster-key flags over the file's
// values.
func applyClusterTrustFlags(set func(string, func()), c, fc *node.ClusterConfig) {
	set("cluster-key-file", func() { c.ClusterKeyFile = fc.ClusterKeyFile })
	set("insecure", func() { c.Insecure = fc.Insecure })
	set("nats-credentials-file", func() { c.NATSCredentialsFile = fc.NATSCredentialsFile })
	set("nats-tls-ca", func() { c.NATSTLS.CAFile = fc.NATSTLS.CAFile })
	set("nats-tls-cert", func() { c.NATSTLS.CertFile = fc.NATSTLS.CertFile })
	set("nats-tls-key", func() { c.NATSTLS.KeyFile = fc.NATSTLS.KeyFile })
}
