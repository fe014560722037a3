package config

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"

	wal "github.com/hashicorp/raft-wal"
	"github.com/hashicorp/raft-wal/fs"
	"github.com/hashicorp/raft-wal/segment"
	"github.com/hashicorp/raft-wal/types"
)

// raft-wal and log tail truncation (hashicorp/raft-wal#31).
//
// raft deletes a suffix of its log in one place only: a follower whose
// entries conflict with the leader's (raft.go, "clearing log suffix"),
// which happens to a leader that appended entries it could not commit (a
// write during a partition, or just before it stepped down) once it
// rejoins under a new leader. raft-wal v0.4.0, which kvmesh used before,
// marked the truncated segment sealed in its metadata without writing the
// segment's index block (the array of entry offsets a sealed segment is
// read through). The running process kept reading it through its
// in-memory index, but after a restart raft-wal's reader failed every read
// in it with "sealed segment has no index block", and raft panicked in
// NewRaft. v0.4.1 writes the index when it truncates. (v0.4.2 needs
// hashicorp/go-metrics/compat, which the go-metrics that raft v1.8.0 and
// memberlist pull in no longer has.)
//
// Data directories written before the upgrade may still hold such a
// segment: kvmesh compacted it away by a snapshot once the FSM had applied
// through it, and a gateway stopped inside that window (ci1218: 1.8 s
// after the truncation, during an election) could not restart. The
// entries themselves are intact in the file: frames in index order, each
// an 8-byte header (type, 3 reserved bytes, little-endian payload length)
// and the payload padded to 8 bytes, after a 32-byte file header; commit
// frames carry a checksum instead of a length and no payload. So the store
// opens raft-wal with scanningFiler, raft-wal's own segment filer except
// that it opens a sealed segment without an index block by walking its
// frames once to find the entries.

// walLog is the raft LogStore: raft-wal, reporting tail truncations.
type walLog struct {
	*wal.WAL
	truncated func(newLast uint64)
}

// DeleteRange implements raft.LogStore.
func (l walLog) DeleteRange(lo, hi uint64) error {
	first, err := l.FirstIndex()
	if err != nil {
		return err
	}
	last, err := l.LastIndex()
	if err != nil {
		return err
	}
	if err := l.WAL.DeleteRange(lo, hi); err != nil {
		return err
	}
	if lo > first && lo <= last && hi >= last {
		l.truncated(lo - 1)
	}
	return nil
}

// tailTruncated counts and logs a tail truncation; it runs on raft's
// goroutine.
func (s *Store) tailTruncated(newLast uint64) {
	s.metrics.tailTruncations.Inc()
	s.log.Info("raft log tail truncated (uncommitted entries replaced by the leader's)", "last_kept", newLast)
}

// openWAL opens raft-wal in dir with scanningFiler.
func openWAL(dir string, meta types.MetaStore) (*wal.WAL, error) {
	sf := scanningFiler{Filer: segment.NewFiler(dir, fs.New()), dir: dir}
	return wal.Open(dir, wal.WithMetaStore(meta), wal.WithSegmentFiler(sf))
}

// scanningFiler is raft-wal's segment filer, opening a sealed segment
// that has no index block (IndexStart 0) by scanning it.
type scanningFiler struct {
	*segment.Filer
	dir string
}

// Open implements types.SegmentFiler; raft-wal calls it for sealed
// segments only.
func (f scanningFiler) Open(info types.SegmentInfo) (types.SegmentReader, error) {
	if info.IndexStart != 0 {
		return f.Filer.Open(info)
	}
	return openScanned(filepath.Join(f.dir, segment.FileName(info)), info)
}

// The segment format's constants (see the comment at the top).
const (
	segFileHeaderLen  = 32
	segFrameHeaderLen = 8
	segMagic          = 0x58eb6b0d // little-endian uint64 of the header's first 8 bytes
	segFrameEntry     = 1
	segFrameIndex     = 2
	segFrameCommit    = 3
)

// scannedSegment reads a sealed segment through entry offsets found by
// scanning its frames.
type scannedSegment struct {
	f       *os.File
	info    types.SegmentInfo
	offsets []int64 // frame offset of entry BaseIndex+i
}

func openScanned(path string, info types.SegmentInfo) (_ *scannedSegment, err error) {
	if info.MaxIndex < info.BaseIndex {
		return nil, fmt.Errorf("%w: sealed segment %s ends at %d, before its base %d", types.ErrCorrupt, path, info.MaxIndex, info.BaseIndex)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = f.Close()
		}
	}()
	var h [segFileHeaderLen]byte
	if _, err := f.ReadAt(h[:], 0); err != nil {
		return nil, fmt.Errorf("%w: segment %s: header: %w", types.ErrCorrupt, path, err)
	}
	le := binary.LittleEndian
	if le.Uint64(h[0:8]) != segMagic || le.Uint64(h[8:16]) != info.BaseIndex ||
		le.Uint64(h[16:24]) != info.ID || le.Uint64(h[24:32]) != info.Codec {
		return nil, fmt.Errorf("%w: segment %s: header does not match its metadata", types.ErrCorrupt, path)
	}
	want := int(info.MaxIndex - info.BaseIndex + 1)
	s := &scannedSegment{f: f, info: info, offsets: make([]int64, 0, want)}
	var fh [segFrameHeaderLen]byte
	for off := int64(segFileHeaderLen); len(s.offsets) < want; {
		if _, err := f.ReadAt(fh[:], off); err != nil {
			return nil, fmt.Errorf("%w: segment %s: %d of %d entries before offset %d: %w",
				types.ErrCorrupt, path, len(s.offsets), want, off, err)
		}
		size := int64(le.Uint32(fh[4:8]))
		switch fh[0] {
		case segFrameEntry:
			s.offsets = append(s.offsets, off)
		case segFrameIndex:
		case segFrameCommit:
			size = 0 // the field is a checksum
		default:
			return nil, fmt.Errorf("%w: segment %s: frame type %d at offset %d after %d of %d entries",
				types.ErrCorrupt, path, fh[0], off, len(s.offsets), want)
		}
		off += segFrameHeaderLen + (size+segFrameHeaderLen-1)/segFrameHeaderLen*segFrameHeaderLen
	}
	return s, nil
}

// GetLog implements types.SegmentReader.
func (s *scannedSegment) GetLog(idx uint64) (*types.PooledBuffer, error) {
	if idx < s.info.MinIndex || idx > s.info.MaxIndex {
		return nil, types.ErrNotFound
	}
	off := s.offsets[idx-s.info.BaseIndex]
	var fh [segFrameHeaderLen]byte
	if _, err := s.f.ReadAt(fh[:], off); err != nil {
		return nil, err
	}
	n := binary.LittleEndian.Uint32(fh[4:8])
	if n > segment.MaxEntrySize {
		return nil, fmt.Errorf("%w: entry %d claims %d bytes", types.ErrCorrupt, idx, n)
	}
	buf := make([]byte, n)
	if _, err := s.f.ReadAt(buf, off+segFrameHeaderLen); err != nil {
		return nil, err
	}
	return &types.PooledBuffer{Bs: buf}, nil
}

// Close implements io.Closer.
func (s *scannedSegment) Close() error { return s.f.Close() }
