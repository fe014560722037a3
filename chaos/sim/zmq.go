package sim

import (
	"fmt"

	"github.com/kvmesh/kvmesh/kvevents"
)

var _ EventPublisher = (*kvevents.Publisher)(nil)

// publisherConfig maps vLLM's --kv-events-config onto kvevents'.
func (c KVEventsConfig) publisherConfig() (kvevents.PublisherConfig, error) {
	p := kvevents.DefaultPublisherConfig()
	p.Endpoint = c.Endpoint
	p.ReplayEndpoint = c.ReplayEndpoint
	p.Topic = c.Topic
	p.BufferSteps = c.BufferSteps
	p.HWM = c.HWM
	p.AlwaysBind = c.AlwaysBind
	if c.Encoding != "" {
		enc, err := kvevents.ParseEncoding(c.Encoding)
		if err != nil {
			return p, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		p.Encoding = enc
	}
	if c.ReplayForm != "" {
		rf, err := kvevents.ParseReplayForm(c.ReplayForm)
		if err != nil {
			return p, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		p.ReplayForm = rf
	}
	if err := p.Validate(); err != nil {
		return p, fmt.Errorf("%w: kv events: %w", ErrInvalidConfig, err)
	}
	return p, nil
}
