package sync

import (
	"encoding/binary"
	"fmt"

	"github.com/hashicorp/memberlist"
)

// NodeMeta is what a gateway advertises about itself through memberlist.
//
// Encoding, version 1 (must fit memberlist.MetaMaxSize, 512 bytes):
//
//	version byte (=1), then 9 strings, each uv length + bytes, in order:
//	cluster, gateway version, HTTP, peer gRPC, raft, NATS route URL,
//	NATS client URL, index modes, admin gRPC; then a flags byte (bit 0: leaving),
//	absent = 0
//
// A decoder of version 1 ignores bytes after the known strings, so later
// versions may append fields.
type NodeMeta struct {
	Cluster    string
	Version    string
	HTTPAddr   string
	PeerAddr   string // gRPC peer service (snapshots)
	RaftAddr   string
	NATSRoute  string // nats-route://host:port of the embedded server ("" = external NATS)
	NATSClient string // client URL of the embedded server (informational)
	IndexModes string
	AdminAddr  string // admin gRPC (config writes are forwarded there)
	// Leaving is set by a gateway that is about to leave gracefully, so that
	// peers tell its departure from a failure.
	Leaving bool
}

const metaVersion = 1

// AppendMeta appends m's encoding, or ErrMetaTooLarge if it exceeds limit.
func AppendMeta(dst []byte, m NodeMeta, limit int) ([]byte, error) {
	start := len(dst)
	dst = append(dst, metaVersion)
	for _, s := range m.fields() {
		dst = appendStr(dst, *s)
	}
	var flags byte
	if m.Leaving {
		flags |= 1
	}
	dst = append(dst, flags)
	if len(dst)-start > limit {
		return dst[:start], fmt.Errorf("%w: %d bytes > %d", ErrMetaTooLarge, len(dst)-start, limit)
	}
	return dst, nil
}

func (m *NodeMeta) fields() []*string {
	return []*string{&m.Cluster, &m.Version, &m.HTTPAddr, &m.PeerAddr, &m.RaftAddr, &m.NATSRoute, &m.NATSClient, &m.IndexModes, &m.AdminAddr}
}

// decodeMeta decodes node metadata. Errors wrap ErrMalformed; it never
// panics.
func decodeMeta(b []byte) (NodeMeta, error) {
	var m NodeMeta
	if len(b) == 0 || len(b) > memberlist.MetaMaxSize {
		return m, fmt.Errorf("%w: metadata of %d bytes", ErrMalformed, len(b))
	}
	if b[0] != metaVersion {
		return m, fmt.Errorf("%w: metadata version %d", ErrMalformed, b[0])
	}
	b = b[1:]
	for _, f := range m.fields() {
		n, k := binary.Uvarint(b)
		if k <= 0 || n > uint64(len(b)-k) {
			return NodeMeta{}, fmt.Errorf("%w: truncated metadata", ErrMalformed)
		}
		*f = string(b[k : k+int(n)])
		b = b[k+int(n):]
	}
	if len(b) > 0 {
		m.Leaving = b[0]&1 != 0
	}
	return m, nil
}
