package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

// MergePatch applies an RFC 7386 JSON merge patch to a JSON document:
// objects merge recursively, null deletes a member, anything else replaces.
// Numbers keep their exact text (a uint64 hash seed survives).
func MergePatch(doc, patch []byte) ([]byte, error) {
	var d, p any
	if err := decodeNumbers(doc, &d); err != nil {
		return nil, fmt.Errorf("merge patch: document: %w", err)
	}
	if err := decodeNumbers(patch, &p); err != nil {
		return nil, fmt.Errorf("merge patch: %w", err)
	}
	return json.Marshal(mergeValue(d, p))
}

func mergeValue(target, patch any) any {
	pm, ok := patch.(map[string]any)
	if !ok {
		return patch
	}
	tm, ok := target.(map[string]any)
	if !ok {
		tm = map[string]any{}
	}
	for k, v := range pm {
		if v == nil {
			delete(tm, k)
			continue
		}
		tm[k] = mergeValue(tm[k], v)
	}
	return tm
}

// MakeMergePatch returns a merge patch that turns from into to (both JSON
// documents). Arrays are replaced whole; a member set to JSON null in to
// cannot be expressed (merge patch semantics) and is treated as removal.
func MakeMergePatch(from, to []byte) ([]byte, error) {
	var f, t any
	if err := decodeNumbers(from, &f); err != nil {
		return nil, fmt.Errorf("merge patch: from: %w", err)
	}
	if err := decodeNumbers(to, &t); err != nil {
		return nil, fmt.Errorf("merge patch: to: %w", err)
	}
	p, _ := diffValue(f, t)
	if p == nil {
		return []byte("{}"), nil
	}
	return json.Marshal(p)
}

// diffValue returns the patch turning f into t and whether there is any
// difference.
func diffValue(f, t any) (any, bool) {
	fm, fok := f.(map[string]any)
	tm, tok := t.(map[string]any)
	if !fok || !tok {
		if jsonEqual(f, t) {
			return nil, false
		}
		return t, true
	}
	out := map[string]any{}
	for k, fv := range fm {
		tv, ok := tm[k]
		if !ok {
			out[k] = nil
			continue
		}
		if d, changed := diffValue(fv, tv); changed {
			out[k] = d
		}
	}
	for k, tv := range tm {
		if _, ok := fm[k]; !ok {
			out[k] = tv
		}
	}
	return out, len(out) > 0
}

func jsonEqual(a, b any) bool {
	ab, err1 := json.Marshal(a)
	bb, err2 := json.Marshal(b)
	return err1 == nil && err2 == nil && bytes.Equal(ab, bb)
}

func decodeNumbers(data []byte, v *any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return errors.New("trailing data after the JSON value")
	}
	return nil
}
