package node

import (
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// value reads a single counter or gauge (one child of a vector).
func value(m prometheus.Metric) float64 {
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		panic(err)
	}
	switch {
	case d.Counter != nil:
		return d.Counter.GetValue()
	case d.Gauge != nil:
		return d.Gauge.GetValue()
	}
	panic("value: not a counter or gauge")
}

// histogram reads a single histogram's sample count and sum (one child of
// a vector).
func histogram(m prometheus.Observer) (count uint64, sum float64) {
	var d dto.Metric
	if err := m.(prometheus.Metric).Write(&d); err != nil {
		panic(err)
	}
	if d.Histogram == nil {
		panic("histogram: not a histogram")
	}
	return d.Histogram.GetSampleCount(), d.Histogram.GetSampleSum()
}
