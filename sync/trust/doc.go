// Package trust turns the cluster key, one secret every gateway of a
// cluster holds, into the credentials gateways use with each other.
//
// Each use gets its own key, derived with HKDF-SHA256 (crypto/hkdf) from
// the cluster key and a fixed label, so that no two uses share bytes and a
// credential leaked from one use (a NATS password read off a host) tells
// nothing about another (the gossip key, the CA):
//
//   - "kvmesh gossip": memberlist's AES-256-GCM key.
//   - "kvmesh ca": the seed of an ed25519 key from which every gateway
//     builds the identical cluster CA certificate (fixed template, fixed
//     validity, derived serial). Each gateway mints its own leaf
//     certificate under it at start (a fresh ed25519 key that never leaves
//     the process). Mutual TLS verified against the CA authenticates and
//     encrypts raft, the peer gRPC service and the NATS route port: a
//     connection proves the key before either side sends a byte of
//     application data, and no bearer secret ever travels.
//   - "kvmesh nats client", "kvmesh nats route": the embedded NATS
//     server's client token and route password (the client port is
//     loopback; the route port also requires the mutual TLS above).
//
// A Ring holds one primary key and any number of older keys. The primary
// encrypts gossip, signs this gateway's leaf and gives the secrets it
// sends; every key's gossip key decrypts, every key's CA is trusted and
// every key's secrets are accepted. Rotation is therefore three rolling
// restarts: add the new key as a second line everywhere, move it to the
// first line everywhere, drop the old line (SECURITY.md).
//
// Key text: one base64 key per line (standard or URL alphabet, padding
// optional), at least 16 bytes decoded; blank lines and lines starting
// with '#' are ignored. Generate prints a new 32-byte key.
package trust
