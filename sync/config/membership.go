package config

import (
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/hashicorp/raft"
)

// Member is one live gateway as the membership layer sees it.
type Member struct {
	// ID is the gateway's stable node id; it is also its raft server id.
	ID string
	// RaftAddr is the host:port of the gateway's raft transport.
	RaftAddr string
	// AdminAddr is the host:port of the gateway's gRPC admin service
	// (operators).
	AdminAddr string
	// ForwardAddr is where other gateways send it forwarded writes and
	// bootstrap status probes (Forward and Status): its peer port, which
	// requires the cluster key, so no gateway sends a credential to a
	// member that has not proven the key. "" = AdminAddr (with
	// StoreConfig.Forward's token: single-purpose setups and tests).
	ForwardAddr string
	// Meta is free-form metadata (version, other addresses); shown by
	// Members, otherwise ignored.
	Meta map[string]string
}

// forwardAddr is where forwarded writes and status probes to m go.
func (m Member) forwardAddr() string {
	if m.ForwardAddr != "" {
		return m.ForwardAddr
	}
	return m.AdminAddr
}

// Membership is what the store needs from the cluster membership layer
// (sync's memberlist implementation satisfies it; StaticMembership is the
// in-memory one for tests and single-node use).
type Membership interface {
	// Members returns the gateways currently alive, including this one.
	// It is called concurrently from several goroutines, must not block,
	// and the caller does not modify the returned slice.
	Members() []Member
	// Changed returns a channel that is closed at the first change of
	// Members after the call (a join, leave, failure or metadata update).
	// Callers call Changed, then Members, then wait on the channel, so no
	// change is missed.
	Changed() <-chan struct{}
}

// StaticMembership is an in-memory Membership whose member list the owner
// sets. Safe for concurrent use.
type StaticMembership struct {
	mu      sync.Mutex
	members []Member
	changed chan struct{}
}

var _ Membership = (*StaticMembership)(nil)

// NewStaticMembership returns a StaticMembership holding members.
func NewStaticMembership(members ...Member) *StaticMembership {
	return &StaticMembership{members: slices.Clone(members), changed: make(chan struct{})}
}

// Members implements Membership.
func (s *StaticMembership) Members() []Member {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.members
}

// Changed implements Membership.
func (s *StaticMembership) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

// Set replaces the member list and notifies waiters.
func (s *StaticMembership) Set(members ...Member) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.members = slices.Clone(members)
	close(s.changed)
	s.changed = make(chan struct{})
}

// Upsert adds m or replaces the member with m's ID, and notifies waiters.
func (s *StaticMembership) Upsert(m Member) {
	s.mu.Lock()
	next := slices.Clone(s.members)
	s.mu.Unlock()
	i := slices.IndexFunc(next, func(x Member) bool { return x.ID == m.ID })
	if i >= 0 {
		next[i] = m
	} else {
		next = append(next, m)
	}
	s.Set(next...)
}

// Remove drops the member with id and notifies waiters.
func (s *StaticMembership) Remove(id string) {
	s.mu.Lock()
	next := slices.DeleteFunc(slices.Clone(s.members), func(x Member) bool { return x.ID == id })
	s.mu.Unlock()
	s.Set(next...)
}

// FuncMembership adapts a member-list function to Membership: its owner
// calls Notify on every membership event. With sync's memberlist Cluster:
//
//	mem := config.NewFuncMembership(func() []config.Member { /* convert cluster.Members() */ })
//	cluster.AddMemberListener(sync.MemberListenerFunc(func(sync.MemberEvent) { mem.Notify() }))
//
// Safe for concurrent use; list must be too, and must not block.
type FuncMembership struct {
	list    func() []Member
	mu      sync.Mutex
	changed chan struct{}
}

var _ Membership = (*FuncMembership)(nil)

// NewFuncMembership returns a FuncMembership listing members with list.
func NewFuncMembership(list func() []Member) *FuncMembership {
	return &FuncMembership{list: list, changed: make(chan struct{})}
}

// Members implements Membership.
func (f *FuncMembership) Members() []Member { return f.list() }

// Changed implements Membership.
func (f *FuncMembership) Changed() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.changed
}

// Notify wakes everyone waiting on Changed.
func (f *FuncMembership) Notify() {
	f.mu.Lock()
	defer f.mu.Unlock()
	close(f.changed)
	f.changed = make(chan struct{})
}

// lookup returns the live member with id.
func lookup(m Membership, id string) (Member, bool) {
	for _, x := range m.Members() {
		if x.ID == id {
			return x, true
		}
	}
	return Member{}, false
}

// smallestIDs returns the n members with the smallest IDs (sorted), the
// deterministic initial voter set.
func smallestIDs(members []Member, n int) []Member {
	s := slices.Clone(members)
	sort.Slice(s, func(i, j int) bool { return s[i].ID < s[j].ID })
	if len(s) > n {
		s = s[:n]
	}
	return s
}

// addressProvider resolves raft server ids to the addresses membership
// currently advertises, so a gateway that restarts on a new port is still
// reachable under its id.
type addressProvider struct{ m Membership }

func (a addressProvider) ServerAddr(id raft.ServerID) (raft.ServerAddress, error) {
	if x, ok := lookup(a.m, string(id)); ok && x.RaftAddr != "" {
		return raft.ServerAddress(x.RaftAddr), nil
	}
	return "", fmt.Errorf("config: no live member %q", id)
}
