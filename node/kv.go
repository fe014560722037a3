package node

import "context"

// startKVEvents starts one subscriber per replica with a KV-event endpoint.
func (n *Node) startKVEvents(ctx context.Context) error { return nil }

// stopKVEvents stops the subscribers and waits for them.
func (n *Node) stopKVEvents() {}
