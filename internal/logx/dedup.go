// Package logx holds the commands' slog plumbing.
package logx

import (
	"context"
	"log/slog"
)

// Dedup wraps h so that every record carries each top-level key once:
// when a key is given again (a logger made With("component", "a") and then
// With("component", "b"), or a record repeating a key of its logger) the
// last value wins, in the place of the first. Components add their own
// context (component, replica, ...) without knowing what their caller's
// logger already holds; this keeps the lines readable and the JSON valid
// for tools that reject duplicate keys. Attributes inside a group
// (WithGroup) are passed through unchanged.
func Dedup(h slog.Handler) slog.Handler { return &dedup{inner: h} }

type dedup struct {
	inner   slog.Handler
	attrs   []slog.Attr // the logger's own attributes, not yet given to inner
	grouped bool        // after WithGroup: inner holds everything, pass through
}

func (d *dedup) Enabled(ctx context.Context, l slog.Level) bool { return d.inner.Enabled(ctx, l) }

func (d *dedup) WithAttrs(as []slog.Attr) slog.Handler {
	if d.grouped {
		return &dedup{inner: d.inner.WithAttrs(as), grouped: true}
	}
	return &dedup{inner: d.inner, attrs: merge(d.attrs, as)}
}

func (d *dedup) WithGroup(name string) slog.Handler {
	if name == "" {
		return d
	}
	return &dedup{inner: d.inner.WithAttrs(d.attrs).WithGroup(name), grouped: true}
}

func (d *dedup) Handle(ctx context.Context, r slog.Record) error {
	if d.grouped {
		return d.inner.Handle(ctx, r)
	}
	own := make([]slog.Attr, 0, r.NumAttrs())
	r.Attrs(func(a slog.Attr) bool { own = append(own, a); return true })
	nr := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
	nr.AddAttrs(merge(d.attrs, own)...)
	return d.inner.Handle(ctx, nr)
}

// merge appends more to base (a copy), a key already present taking the
// new value in its old place.
func merge(base, more []slog.Attr) []slog.Attr {
	out := make([]slog.Attr, len(base), len(base)+len(more))
	copy(out, base)
next:
	for _, a := range more {
		if a.Key == "" && a.Value.Kind() != slog.KindGroup {
			continue
		}
		for i := range out {
			if out[i].Key == a.Key {
				out[i] = a
				continue next
			}
		}
		out = append(out, a)
	}
	return out
}
