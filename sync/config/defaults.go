package config

// DefaultAdminPort is the TCP port on which a gateway serves the admin
// gRPC API by default (node.DefaultClusterConfig listens on
// 0.0.0.0:DefaultAdminPort) and which the admin commands dial by default
// (admincli.DefaultAddr, on loopback). One constant, so the two cannot
// drift apart.
const DefaultAdminPort = "7948"
