package config

import (
	"encoding/json"
	"fmt"
)

// Op names a config command.
type Op string

// Commands carried in the raft log.
const (
	// OpSet replaces the whole document.
	OpSet Op = "set"
	// OpPatch applies a JSON merge patch to the document.
	OpPatch Op = "patch"
	// OpAddReplica appends a replica to a model's pool.
	OpAddReplica Op = "add_replica"
	// OpRemoveReplica removes a replica from a model's pool.
	OpRemoveReplica Op = "remove_replica"
)

// commandFormat is the first byte of every encoded command, so the log
// format can evolve.
const commandFormat byte = 1

// Command is one write to the routing config. Build it with SetCommand,
// PatchCommand, AddReplicaCommand or RemoveReplicaCommand.
type Command struct {
	Op Op `json:"op"`
	// Config is the new document (OpSet).
	Config *RoutingConfig `json:"config,omitempty"`
	// Patch is an RFC 7386 merge patch (OpPatch).
	Patch json.RawMessage `json:"patch,omitempty"`
	// ExpectedVersion, when set, makes the command a compare-and-set.
	ExpectedVersion *uint64 `json:"expected_version,omitempty"`
	// Model names the pool (OpAddReplica, OpRemoveReplica).
	Model string `json:"model,omitempty"`
	// Replica is the replica to add (OpAddReplica).
	Replica *ReplicaConfig `json:"replica,omitempty"`
	// Name is the replica to remove (OpRemoveReplica).
	Name string `json:"name,omitempty"`
}

// SetCommand replaces the document; expected, if non-nil, is the version
// it must replace.
func SetCommand(c RoutingConfig, expected *uint64) Command {
	return Command{Op: OpSet, Config: &c, ExpectedVersion: expected}
}

// PatchCommand merges patch into the document.
func PatchCommand(patch []byte, expected *uint64) Command {
	return Command{Op: OpPatch, Patch: json.RawMessage(patch), ExpectedVersion: expected}
}

// AddReplicaCommand adds r to model's pool.
func AddReplicaCommand(model string, r ReplicaConfig) Command {
	return Command{Op: OpAddReplica, Model: model, Replica: &r}
}

// RemoveReplicaCommand removes the replica named name from model's pool.
func RemoveReplicaCommand(model, name string) Command {
	return Command{Op: OpRemoveReplica, Model: model, Name: name}
}

// Version returns a pointer to v, for ExpectedVersion.
func Version(v uint64) *uint64 { return &v }

func encodeCommand(c Command) ([]byte, error) {
	b, err := json.Marshal(c)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadCommand, err)
	}
	return append([]byte{commandFormat}, b...), nil
}

func decodeCommand(data []byte) (Command, error) {
	var c Command
	if len(data) == 0 || data[0] != commandFormat {
		return c, fmt.Errorf("%w: unknown format byte", ErrBadCommand)
	}
	if err := json.Unmarshal(data[1:], &c); err != nil {
		return c, fmt.Errorf("%w: %w", ErrBadCommand, err)
	}
	switch c.Op {
	case OpSet:
		if c.Config == nil {
			return c, fmt.Errorf("%w: set without config", ErrBadCommand)
		}
	case OpPatch:
		if len(c.Patch) == 0 {
			return c, fmt.Errorf("%w: patch without patch", ErrBadCommand)
		}
	case OpAddReplica:
		if c.Replica == nil || c.Model == "" {
			return c, fmt.Errorf("%w: add_replica wants model and replica", ErrBadCommand)
		}
	case OpRemoveReplica:
		if c.Name == "" || c.Model == "" {
			return c, fmt.Errorf("%w: remove_replica wants model and name", ErrBadCommand)
		}
	default:
		return c, fmt.Errorf("%w: unknown op %q", ErrBadCommand, c.Op)
	}
	return c, nil
}

// apply computes the document that results from applying c to cur (nil:
// no config yet) and validates it. It never modifies cur.
func (c Command) apply(cur *Versioned) (*RoutingConfig, error) {
	var version uint64
	if cur != nil {
		version = cur.Version
	}
	if c.ExpectedVersion != nil && *c.ExpectedVersion != version {
		return nil, fmt.Errorf("%w: expected version %d, current is %d", ErrVersionConflict, *c.ExpectedVersion, version)
	}
	var next RoutingConfig
	switch c.Op {
	case OpSet:
		next = c.Config.Clone()
	case OpPatch:
		base := DefaultRoutingConfig()
		if cur != nil && cur.Config != nil {
			base = *cur.Config
		}
		doc, err := json.Marshal(&base)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadCommand, err)
		}
		merged, err := MergePatch(doc, c.Patch)
		if err != nil {
			return nil, &FieldError{Path: "(patch)", Err: err}
		}
		if next, err = decodeDocument(merged); err != nil {
			return nil, err
		}
	case OpAddReplica, OpRemoveReplica:
		if cur == nil || cur.Config == nil {
			return nil, fmt.Errorf("%w: model %q (no config yet)", ErrNotFound, c.Model)
		}
		next = cur.Config.Clone()
		m, ok := next.Models[c.Model]
		if !ok {
			return nil, fmt.Errorf("%w: model %q", ErrNotFound, c.Model)
		}
		if c.Op == OpAddReplica {
			m.Replicas = append(m.Replicas, *c.Replica)
		} else {
			kept := m.Replicas[:0]
			for _, r := range m.Replicas {
				if r.Name != c.Name {
					kept = append(kept, r)
				}
			}
			if len(kept) == len(m.Replicas) {
				return nil, fmt.Errorf("%w: replica %q in model %q", ErrNotFound, c.Name, c.Model)
			}
			m.Replicas = kept
		}
		next.Models[c.Model] = m
	default:
		return nil, fmt.Errorf("%w: unknown op %q", ErrBadCommand, c.Op)
	}
	if err := next.Validate(); err != nil {
		return nil, err
	}
	return &next, nil
}
